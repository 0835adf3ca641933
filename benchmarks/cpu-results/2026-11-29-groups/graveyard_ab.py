"""In one process, rounds alternated: the tier's unpack with deaths settled one at a time
(GRAVEYARD_BATCH 1, as before) and a batch at a time (Note [deaths that hold no memory wait])."""
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import pack_cost  # noqa: E402

from ssdtrain.bench.models import GPT, GPTConfig  # noqa: E402
from ssdtrain.engine import offloader  # noqa: E402
from ssdtrain.engine import unpack as hooks  # noqa: E402  (GRAVEYARD_BATCH is read there since 2026-11-29)

offloader._TIER_DEVICES = ("cuda", "cpu")
torch.set_num_threads(1)
torch.manual_seed(0)
model = GPT(GPTConfig(vocab=512, seq=64, layers=12, hidden=64, heads=4))
tokens = torch.randint(0, 512, (2, 64))
runs = {1: [], hooks.GRAVEYARD_BATCH: []}
with tempfile.TemporaryDirectory() as path:
    for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 7):
        for batch in runs:
            hooks.GRAVEYARD_BATCH = batch
            runs[batch].append(pack_cost.measure("tier", model, tokens, 20, path))
for batch, rs in runs.items():
    med = {k: statistics.median(r[k] for r in rs) for k in ("pack_us", "unpack_us", "step_all_threads_ms")}
    print(f"GRAVEYARD_BATCH {batch:2d}: pack {med['pack_us']:.1f} us, unpack {med['unpack_us']:.1f} us, "
          f"step (all threads) {med['step_all_threads_ms']:.2f} ms; unpack rounds "
          + " ".join(f"{r['unpack_us']:.1f}" for r in rs))
