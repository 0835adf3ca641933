"""Where the host tier's cost to the training thread goes, under checkpointing, on a GPU (issue 29).

At the bench's GPU shape with ``torch.utils.checkpoint`` per block, forward is nearly host-bound
(its host time about 80% of its device time on an H200), so whatever the tier costs the training
thread lengthens the step. This runs ``recompute`` beside ``recompute+offload`` with the host's
pacing off (every block input it may copy is copied) in a few variants, alternated round by round
in one process, and splits each forward's host time:

* ``host fwd``: wall time of the forward on the training thread;
* ``thread cpu``: the training thread's CPU time in it (``time.thread_time``);
* ``blocked``: the difference: the training thread asleep (the GIL held by another thread, a lock,
  a driver call that waits);
* ``others cpu``: every other thread's CPU time meanwhile (``process_time`` less the thread's);
* ``in hooks``: wall time inside ssdtrain's pack hook;

and backward's: ``host bwd`` (``loss.backward()`` on the host), ``dev bwd`` (on the device), and
``in unpack`` (wall time inside ssdtrain's unpack hook, on autograd's thread).

Variants: ``recompute`` (the reference); ``tier`` (defaults, pacing off); ``tier_torch`` (the tier's
copies to the pool issued through torch, not ctypes); ``tier_si`` (``sys.setswitchinterval(5e-5)``
during its steps: the GIL handed over 100 times sooner). ``--trace DIR`` also writes a
``torch.profiler`` trace (gzipped Chrome JSON, CPU and CUDA) of two steps of each variant: where
the compute stream waits in backward.

Run it without ``CUBLAS_WORKSPACE_CONFIG`` (``.ci/gpu-check hostcost`` does): with it set, torch
2.11 parses it with a regex at every cuBLAS matmul, and forward becomes host-bound as a user's is
not (py-spy on an H200, 2026-11-27).

    python benchmarks/investigations/tier_host_cost.py [--layers 12 --hidden 2048 --seq 2048 --batch 4] [--json F] [--trace DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gzip
import json
import os
import pstats
import shutil
import statistics
import sys
import time

import torch

import ssdtrain
from ssdtrain.bench.models import GPT, GPTConfig
from ssdtrain.device import copies
from ssdtrain.engine.hooks import SaveHooks

VARIANTS = ("recompute", "tier", "tier_torch", "tier_si")


class HookTimer:
    """Wall time inside one of ``SaveHooks``' hooks (``name``), summed: wraps it for the process."""

    def __init__(self, name: str) -> None:
        self.seconds, self.calls = 0.0, 0
        orig = getattr(SaveHooks, name)
        timer = self

        def timed(hooks, t):
            t0 = time.perf_counter()
            try:
                return orig(hooks, t)
            finally:
                timer.seconds += time.perf_counter() - t0
                timer.calls += 1
        setattr(SaveHooks, name, timed)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--path", default=None)
    ap.add_argument("--profile", action="store_true", help="cProfile 5 steps of recompute and of tier, after")
    ap.add_argument("--json", default=None)
    ap.add_argument("--trace", default=None, metavar="DIR", help="write a profiler trace of 2 steps per variant here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("tier_host_cost: no CUDA device")
        return 1
    variants = args.variants.split(",")
    for v in variants:
        if v not in VARIANTS:
            ap.error(f"--variants: unknown {v!r} (known: {', '.join(VARIANTS)})")
    cfg = GPTConfig(vocab=args.vocab, seq=args.seq, layers=args.layers, hidden=args.hidden, heads=args.heads)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = GPT(cfg).to(torch.bfloat16)
    model.recompute = True
    tokens = torch.randint(0, cfg.vocab, (args.batch, cfg.seq + 1), device="cuda")
    x, y = tokens[:, :-1], tokens[:, 1:]
    path = {} if args.path is None else {"path": args.path}
    offs = {}
    for v in variants:
        if v != "recompute":
            offs[v] = ssdtrain.Offloader(model, min_bytes=0, **path)
            offs[v]._tier.clock._pace = lambda host: None  # every block input it may copy
    hooks, unpacks = HookTimer("_pack"), HookTimer("_unpack")
    runtime = copies._cudart()  # loaded once CUDA is up (torch's libcudart); None: none found
    switch = sys.getswitchinterval()

    @contextlib.contextmanager
    def variant(v):
        if v == "tier_torch":
            copies._runtime = False
        if v == "tier_si":
            sys.setswitchinterval(5e-5)
        try:
            with offs[v] if v in offs else contextlib.nullcontext():
                yield
        finally:
            copies._runtime = runtime if runtime is not None else False
            sys.setswitchinterval(switch)

    rows: dict[str, list[dict]] = {v: [] for v in variants}
    for r in range(args.warmup + args.rounds):
        for v in (variants if r % 2 == 0 else variants[::-1]):
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            before = offs[v].stats().host_copied_bytes if v in offs else 0
            e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            h0, c0, p0, n0 = hooks.seconds, time.thread_time(), time.process_time(), hooks.calls
            t0 = time.perf_counter()
            e0.record()
            with variant(v):
                loss = model(x, y)
                wall = time.perf_counter() - t0
                cpu, proc = time.thread_time() - c0, time.process_time() - p0
                in_hooks, packs = hooks.seconds - h0, hooks.calls - n0
            e1.record()
            u0, b0 = unpacks.seconds, time.perf_counter()
            loss.backward()
            host_bwd = time.perf_counter() - b0
            e2.record()
            torch.cuda.synchronize()
            step = time.perf_counter() - t0
            if v in offs:
                offs[v].wait()
            row = {"step_ms": step * 1e3, "dev_fwd_ms": e0.elapsed_time(e1), "host_fwd_ms": wall * 1e3,
                   "thread_cpu_ms": cpu * 1e3, "blocked_ms": (wall - cpu) * 1e3, "others_cpu_ms": (proc - cpu) * 1e3,
                   "in_hooks_ms": in_hooks * 1e3, "packs": packs, "host_bwd_ms": host_bwd * 1e3,
                   "dev_bwd_ms": e1.elapsed_time(e2), "in_unpack_ms": (unpacks.seconds - u0) * 1e3,
                   "copied_mib": ((offs[v].stats().host_copied_bytes - before) / 2**20) if v in offs else 0.0}
            if r >= args.warmup:
                rows[v].append(row)
    med = {v: {k: statistics.median(row[k] for row in rs) for k in rs[0]} for v, rs in rows.items()}
    print(f"{torch.cuda.get_device_name()}: recompute at {args.layers}x{args.hidden}, seq {args.seq}, batch "
          f"{args.batch}; ctypes runtime {'found' if runtime else 'absent'}; medians of {args.rounds} rounds (ms)")
    for keys in (("step_ms", "dev_fwd_ms", "host_fwd_ms", "thread_cpu_ms", "blocked_ms", "others_cpu_ms",
                  "in_hooks_ms", "packs", "copied_mib"), ("dev_bwd_ms", "host_bwd_ms", "in_unpack_ms")):
        print(f"{'variant':11s} " + " ".join(f"{k[:-3] if k.endswith('_ms') else k:>13s}" for k in keys))
        for v, m in med.items():
            print(f"{v:11s} " + " ".join(f"{m[k]:13.1f}" for k in keys))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "args": vars(args), "medians": med, "rows": rows}, f,
                      indent=1)
    if args.trace:
        os.makedirs(args.trace, exist_ok=True)
        for v in variants:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(2):
                    model.zero_grad(set_to_none=True)
                    with variant(v):
                        loss = model(x, y)
                    loss.backward()
                    torch.cuda.synchronize()
                    if v in offs:
                        offs[v].wait()
            raw = os.path.join(args.trace, f"trace-{v}.json")
            prof.export_chrome_trace(raw)
            with open(raw, "rb") as src, gzip.open(raw + ".gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.remove(raw)
            print(f"trace of 2 {v} steps: {raw}.gz")
    if args.profile:
        for v in ("recompute", "tier"):
            if v not in variants:
                continue
            prof = cProfile.Profile()
            for _ in range(5):
                model.zero_grad(set_to_none=True)
                torch.cuda.synchronize()
                prof.enable()
                with variant(v):
                    loss = model(x, y)
                prof.disable()
                loss.backward()
                torch.cuda.synchronize()
                if v in offs:
                    offs[v].wait()
            print(f"--- {v}: 5 forwards on the training thread, by own time")
            pstats.Stats(prof).sort_stats("tottime").print_stats(14)
    for off in offs.values():
        off.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
