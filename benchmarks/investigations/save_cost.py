"""The training thread's cost per saved tensor, side by side in one run: a chain of small
matmuls and tanh (compute is negligible), under no hooks, under the offloader keeping every
save (as a Small: Note [a small save skips the cache]; and through entries, as before that
Note), and writing every save to host memory.

    python benchmarks/investigations/save_cost.py [--ops 300] [--rounds 15]

Prints the median step time of each mode and the extra time per save against no hooks.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time

import torch

import ssdtrain


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", type=int, default=300)
    ap.add_argument("--size", type=int, default=64, help="matrices are size x size (fp32)")
    ap.add_argument("--rounds", type=int, default=15)
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    ws = [torch.randn(a.size, a.size, requires_grad=True) for _ in range(a.ops)]
    x0 = torch.randn(a.size, a.size)
    saves = [0]

    def count(t):
        saves[0] += 1
        return t

    def step(ctx) -> float:
        t = time.perf_counter()
        x = x0
        with ctx:
            for w in ws:
                x = torch.tanh(x @ w)
        x.sum().backward()
        return time.perf_counter() - t

    path = tempfile.mkdtemp(prefix="ssdtrain-save-cost-")
    small = ssdtrain.Offloader(path=path, backend="memory", min_bytes=1 << 40)
    entries = ssdtrain.Offloader(path=path, backend="memory", min_bytes=1 << 40)
    entries._small_bytes = 0  # every save through an entry (kept as "small" by the policy)
    written = ssdtrain.Offloader(path=path, backend="memory", min_bytes=0)
    modes = {"no hooks": lambda: contextlib.nullcontext(), "kept (Small)": lambda: small,
             "kept (entries)": lambda: entries, "written": lambda: written}
    step(torch.autograd.graph.saved_tensors_hooks(count, lambda t: t))
    times: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(a.rounds + 1):
        for name, ctx in modes.items():
            dt = step(ctx())
            for off in (small, entries, written):
                off.wait()
            if r:
                times[name].append(dt)
    base = statistics.median(times["no hooks"])
    print(f"{a.ops} ops, {saves[0]} saves per step; medians of {a.rounds} rounds, modes alternated")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:15s} {med * 1e3:8.2f} ms   +{(med - base) / saves[0] * 1e6:6.1f} us per save")
    for off in (small, entries, written):
        off.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
