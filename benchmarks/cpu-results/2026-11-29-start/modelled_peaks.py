"""The forward's and the backward's peaks of a small GPT on a modelled H100, step by step, and what is
allocated as backward begins: the host tier's groups of 8 storages (the default), 16, 32, an entry a
save, and no offloading. Virtual time: exact and repeatable. ``python modelled_peaks.py [layers]``
(``modelled_peaks.txt``: 4 and 8 blocks on this session's tree; the carve directory beside has the
same rows before it, printed by this script's earlier form, since removed)."""
import contextlib
import sys

import torch

import ssdtrain
from ssdtrain.bench.models import GPT, GPTConfig
from ssdtrain.device.model import ModelledGPU, modelled
from ssdtrain.device.model_ops import ModelledCompute
from ssdtrain.device.rates import H100

LAYERS = int(sys.argv[1]) if len(sys.argv) > 1 else 4
CFG = GPTConfig(vocab=128, seq=64, layers=LAYERS, hidden=64, heads=4)
VARIANTS = {"16 storages": {"_group_saves": 16},
    "8 storages (default)": {},
    "32 storages": {"_group_saves": 32},
    "an entry a save": {"_group_saves": 1},
    "no offloading": None,
}


def peaks(setup, steps=5):
    torch.manual_seed(0)
    model = GPT(CFG)
    x, y = torch.randint(0, CFG.vocab, (2, CFG.seq)), torch.randint(0, CFG.vocab, (2, CFG.seq))
    gpu = ModelledGPU(H100, seed=0, jitter=0.1)
    out, losses = [], []
    with modelled(gpu):
        gpu.adopt(*model.parameters(), x, y)
        off = None
        if setup is not None:
            off = ssdtrain.Offloader(model, min_bytes=0, backend="memory", host_bytes=8 << 20)
            for k, v in setup.items():
                setattr(off, k, v)
        with ModelledCompute(gpu):
            for _ in range(steps):
                model.zero_grad(set_to_none=True)
                gpu.reset_peak()
                with off if off is not None else contextlib.nullcontext():
                    loss = model(x, y)
                gpu.synchronize()
                fwd = gpu.peak()
                start = gpu.allocated()
                gpu.reset_peak()
                loss.backward()
                if off is not None:
                    off.wait()
                gpu.synchronize()
                out.append((fwd, gpu.peak(), start))
                losses.append(loss.item())
        if off is not None:
            off.close()
    return out, losses


results = {name: peaks(setup) for name, setup in VARIANTS.items()}
base = results["no offloading"][1]
print(f"modelled H100, GPT {LAYERS} layers x 64, seq 64, batch 2; each of 5 steps: forward peak / backward peak @ allocated as backward begins (bytes)")
for name, (p, losses) in results.items():
    print(f"{name:26s} " + " ".join(f"{f:,d}/{b:,d}@{s:,d}" for f, b, s in p) + ("" if losses == base else "  LOSSES DIFFER"))
