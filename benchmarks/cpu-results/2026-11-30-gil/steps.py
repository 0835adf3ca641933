"""pack_cost's GPT (12 blocks, 301 saves a step) for N steps, with identity hooks or the host tier on
CPU tensors; prints the process CPU time a step. `python steps.py identity|tier STEPS` from the repository root."""
import sys, time, tempfile
import torch, ssdtrain
from ssdtrain.engine import offloader as offloader_mod
from ssdtrain.bench.models import GPT, GPTConfig
mode = sys.argv[1]; steps = int(sys.argv[2])
offloader_mod._TIER_DEVICES = ("cuda", "cpu")
torch.set_num_threads(1); torch.manual_seed(0)
model = GPT(GPTConfig(vocab=512, seq=64, layers=12, hidden=64, heads=4))
tokens = torch.randint(0, 512, (2, 64))
with tempfile.TemporaryDirectory() as path:
    if mode == "identity":
        ctx = lambda: torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
        off = None
    else:
        off = ssdtrain.Offloader(model, path=path, min_bytes=0, backend="memory")
        ctx = lambda: off
    for i in range(steps):
        if i == 5: t0 = time.process_time(); w0 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        with ctx():
            loss = model(tokens, tokens)
        loss.backward()
        if off is not None: off.wait()
    print(mode, "cpu ms/step", (time.process_time() - t0) / (steps - 5) * 1e3, "wall", (time.perf_counter() - w0) / (steps - 5) * 1e3)
    if off: off.close()
