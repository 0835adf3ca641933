"""In one process, rounds alternated: the tier's pack with groups of 32 storages
(Note [a group's parts are carved from one region]) and with a host extent a part (``_carve`` False,
the path before it). ``python carve_ab.py [rounds]``."""
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import pack_cost  # noqa: E402

import ssdtrain  # noqa: E402
from ssdtrain.bench.models import GPT, GPTConfig  # noqa: E402
from ssdtrain.engine import offloader  # noqa: E402

offloader._TIER_DEVICES = ("cuda", "cpu")
torch.set_num_threads(1)
torch.manual_seed(0)
model = GPT(GPTConfig(vocab=512, seq=64, layers=12, hidden=64, heads=4))
tokens = torch.randint(0, 512, (2, 64))
Base = ssdtrain.Offloader


def made(carve):
    class Off(Base):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self._group_saves = 32 if carve else 8
    return Off


runs = {True: [], False: []}
with tempfile.TemporaryDirectory() as path:
    for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 7):
        for carve in runs:
            pack_cost.ssdtrain.Offloader = made(carve)
            runs[carve].append(pack_cost.measure("tier", model, tokens, 20, path))
keys = ("pack_us", "pack_calls", "unpack_us", "step_all_threads_ms")
for carve, rs in runs.items():
    med = {k: statistics.median(r[k] for r in rs) for k in keys}
    print(f"carve {carve!s:5s}: pack {med['pack_us']:.2f} us ({med['pack_calls']:.1f} calls), unpack "
          f"{med['unpack_us']:.2f} us, step (all threads) {med['step_all_threads_ms']:.2f} ms; pack rounds "
          + " ".join(f"{r['pack_us']:.1f}" for r in rs))
pairs = [a["pack_us"] / b["pack_us"] for a, b in zip(runs[True], runs[False])]
steps = [a["step_all_threads_ms"] / b["step_all_threads_ms"] for a, b in zip(runs[True], runs[False])]
print(f"carved over not, median of pairs: pack x{statistics.median(pairs):.3f}, step all threads x{statistics.median(steps):.3f}")
