"""Issue 64's item 4's case in fake time: 8 checkpointed blocks, a block every DT, a block input written in
1.8 blocks' time (8.4 MB at 25 MB/s against 0.19 s a block); the fall of the peak over what the
drive could take before the forward's end, per step.

    PYTHONPATH=<checkout> python fake_time_share.py
"""
import math, sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))  # the checkout's tests/_clock_store.py
import torch
import ssdtrain
import ssdtrain.engine.hooks as hooks_module
from ssdtrain.engine.peak import possible_bytes
from ssdtrain.bench.models import GPT, GPTConfig
from _clock_store import ClockStore
now = [100.0]
hooks_module._now = lambda: now[0]
DT = 0.19
torch.manual_seed(0)
model = GPT(GPTConfig(vocab=64, seq=256, layers=8, hidden=128, heads=4))
model.recompute = True
tokens = torch.randint(0, 64, (8, 256), generator=torch.Generator().manual_seed(0))
block_bytes = tokens.numel() * 128 * 4
bps = block_bytes / (0.34 / 0.19 * DT)
store = ClockStore(now, bps)
handles = [b.register_forward_pre_hook(lambda m, a: store.advance(now[0] + DT)) for b in model.blocks]
off = ssdtrain.Offloader(model, store=store, min_bytes=0)
rows = []
for i in range(8):
    before = off.stats()
    off.reset_peak()
    model.zero_grad(set_to_none=True)
    t0 = now[0]
    with off:
        loss = model(tokens, tokens)
    store.advance(now[0] + DT)
    fwd = now[0] - t0
    loss.backward()
    store.advance(math.inf)
    off.wait()
    a = off.stats()
    unique = a.unique_bytes - before.unique_bytes
    bound = possible_bytes(bps, len(model.blocks) * DT, unique)
    rows.append((round(a.peak_fall_bytes / block_bytes, 2), round(bound / block_bytes, 2), round(a.peak_fall_bytes / bound, 2)))
print(ssdtrain.__file__, "fall (block inputs), bound (block inputs), share:", rows)
