"""Where an offloaded GPU step's extra time goes: host CPU of the saved-tensor hooks, or a wait
on the device. Runs the bench's GPT on CUDA and, per mode (baseline; offload; count-only, hooks
that only count), reports:

* ``host ms per step``: the training thread's wall time in forward, backward and the optimizer,
  and within them in the offloader's pack and unpack hooks;
* ``step``: synchronized step time (median), as the bench;
* ``cpu``: the training thread's CPU seconds per step (``time.thread_time``);
* ``host while device spins``: the time to *queue* a step while the device is held busy by a
  spin kernel queued first (``torch.cuda._sleep``). If no hook waits for the device, queueing
  ends long before the spin does;
* optionally the top of a cProfile of offloaded steps (``--profile N``; on Python 3.12 it counts
  every thread), every thread's Python stack a set time into a step queued behind the spin
  (``--dump-after S``), and their native stacks through ``cuda-gdb`` (``--native-stacks FILE``).

    python benchmarks/investigations/gpu_overhead.py [--layers 8 --hidden 256 ...] [--backend posix] [--path DIR] [--recompute]

``--recompute``: each block under ``torch.utils.checkpoint`` and ``min_bytes=0``, as the bench's
``recompute+offload``; ``baseline`` is then recompute. On the H200 (2026-11-27) that mode's
host forward took 9 ms more than recompute's for about 25 saves (issue 29, item 4).

First run on an H100, 2026-11-24: benchmarks/RESULTS.md ("The first GPU run").
"""

from __future__ import annotations

import argparse
import cProfile
import os
import subprocess
import threading
import faulthandler
import io
import pstats
import statistics
import sys
import tempfile
import time
import types

import torch

import ssdtrain
from ssdtrain.bench.models import GPT, GPTConfig


def _native_stacks(path: str) -> None:
    cmd = ["cuda-gdb", "-p", str(os.getpid()), "-batch", "-ex", "thread apply all bt 30"]
    with open(path, "w") as f:
        subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=60, check=False)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--backend", default="memory")
    ap.add_argument("--path", default=None)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--recompute", action="store_true",
                    help="each block under torch.utils.checkpoint, min_bytes=0 (recompute+offload: "
                         "the offloader sees the block inputs; the baseline is recompute)")
    ap.add_argument("--spin-ms", type=float, default=2000)
    ap.add_argument("--profile", type=int, default=25, help="cProfile rows (0: none)")
    ap.add_argument("--switch-interval", type=float, help="sys.setswitchinterval for this run (GIL hand-over)")
    ap.add_argument("--tier-threads", action="store_true",
                    help="the tier's copies made on its copy threads, as before 2026-11-30 (Note [copies are "
                         "made where they are handed over] in ssdtrain/host/tier.py)")
    ap.add_argument("--native-stacks", metavar="FILE",
                    help="with --dump-after: also write every thread's native stack (cuda-gdb attaches) to FILE")
    ap.add_argument("--dump-after", type=float, default=0.0,
                    help="seconds into a step queued behind the spin: print every thread's stack (0: never)")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_overhead: needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    if a.switch_interval:
        sys.setswitchinterval(a.switch_interval)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=a.vocab, seq=a.seq, layers=a.layers, hidden=a.hidden, heads=a.heads)
    model = GPT(cfg, recompute=a.recompute).to(dev, torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, a.vocab, (a.batch, a.seq), device=dev)
    path = a.path or tempfile.mkdtemp(prefix="ssdtrain-overhead-")
    off = ssdtrain.Offloader(model, path=path, backend=a.backend, **({"min_bytes": 0} if a.recompute else {}))
    if a.tier_threads and off._tier is not None:
        off._tier.inline_copies(False)
    saves = [0]

    def count(t):
        saves[0] += 1
        return t

    spent = {"pack": 0.0, "unpack": 0.0, "forward": 0.0, "backward": 0.0, "optimizer": 0.0}

    def timed(name, fn):  # a bound method, as the offloader's hooks are
        def run(_self, *args):
            t = time.perf_counter()
            try:
                return fn(*args)
            finally:
                spent[name] += time.perf_counter() - t
        return types.MethodType(run, off)

    off._pack, off._unpack = timed("pack", off._pack), timed("unpack", off._unpack)

    def step(ctx):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with ctx:
            loss = model(tokens, tokens)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        for k, v in (("forward", t1 - t0), ("backward", t2 - t1), ("optimizer", t3 - t2)):
            spent[k] += v

    import contextlib
    modes = {"baseline": contextlib.nullcontext, "offload": lambda: off,
             "count-only": lambda: torch.autograd.graph.saved_tensors_hooks(count, lambda t: t)}
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    c0 = 50_000_000
    t = time.perf_counter()
    torch.cuda._sleep(c0)
    torch.cuda.synchronize()
    per_ms = c0 / ((time.perf_counter() - t) * 1000)
    for name, ctx in modes.items():
        for _ in range(2):
            step(ctx())
        off.wait()
        torch.cuda.synchronize()
        times, cpus, hosts = [], [], []
        for k in spent:
            spent[k] = 0.0
        for _ in range(a.steps):
            torch.cuda.synchronize()
            t, c = time.perf_counter(), time.thread_time()
            step(ctx())
            c = time.thread_time() - c
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
            cpus.append(c)
            off.wait()
        print(f"{name:10s} host ms per step: " + ", ".join(f"{k} {v / a.steps * 1e3:.1f}" for k, v in spent.items()))
        for _ in range(3):
            torch.cuda.synchronize()
            torch.cuda._sleep(int(per_ms * a.spin_ms))
            t = time.perf_counter()
            if a.dump_after and name == "offload" and not hosts:
                faulthandler.dump_traceback_later(a.dump_after, file=sys.stdout)
                if a.native_stacks:
                    threading.Timer(a.dump_after, _native_stacks, (a.native_stacks,)).start()
            step(ctx())
            faulthandler.cancel_dump_traceback_later()
            hosts.append(time.perf_counter() - t)
            torch.cuda.synchronize()
            off.wait()
        print(f"{name:10s} step {statistics.median(times) * 1e3:8.1f} ms  cpu {statistics.median(cpus) * 1e3:8.1f} ms"
              f"  host while device spins {a.spin_ms:.0f} ms: {statistics.median(hosts) * 1e3:8.1f} ms", flush=True)
    saves[0] = 0
    step(modes["count-only"]())
    print(f"saves per step: {saves[0]}; offloader: {off.stats()}")
    if a.profile:
        prof = cProfile.Profile()
        torch.cuda.synchronize()
        prof.enable()
        for _ in range(a.steps):
            step(off)
        torch.cuda.synchronize()
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(a.profile)
        print(s.getvalue())
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("cumtime").print_stats(a.profile)
        print(s.getvalue())
    off.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
