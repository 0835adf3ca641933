"""What moving the offloader's bytes costs compute on this machine, without the offloader.

Trains the step-time benchmark's decoder with no offloading at all, alternating rounds in which a
separate process reads and writes a file with O_DIRECT at a fixed rate (by default what the
offloader moves in that benchmark: about 1.04 GB per ~2.4 s step). The ratio of the two step
times is the price the machine charges for that traffic alone (interrupts, the hypervisor's
block path, threads waking up on busy cores), the floor under ``step_time.py``'s ratio.

Usage::

    python benchmarks/io_interference.py                      # 0.43 GB/s to $SSDTRAIN_PATH or /tmp
    python benchmarks/io_interference.py --gbps 0.2 --steps 16 --path /nvme
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from ssdtrain._measure import stolen_seconds, usual_allocations
from ssdtrain.models import GPT, preset

# The traffic: half writes, half reads, in 8 MiB requests over a 512 MiB region, paced.
_TRAFFIC = r"""
import mmap, os, sys, tempfile, time
gbps, path = float(sys.argv[1]), sys.argv[2]
chunk, size = 8 << 20, 512 << 20
fd, name = tempfile.mkstemp(dir=path)
os.close(fd)
fd = os.open(name, os.O_RDWR | getattr(os, "O_DIRECT", 0))
os.unlink(name)
buf = mmap.mmap(-1, size)
buf.write(b"\x5a" * size)
mv = memoryview(buf)
for off in range(0, size, chunk):
    os.pwrite(fd, mv[off:off + chunk], off)
print("ready", flush=True)
start, moved, i = time.perf_counter(), 0, 0
while True:
    off = (i * chunk) % size
    if (i // 64) % 2 == 0:
        os.pwrite(fd, mv[off:off + chunk], off)
    else:
        os.preadv(fd, [mv[off:off + chunk]], off)
    i += 1
    moved += chunk
    ahead = moved / (gbps * 1e9) - (time.perf_counter() - start)
    if ahead > 0:
        time.sleep(ahead)
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gbps", type=float, default=0.43, help="background traffic, GB/s (default 0.43)")
    ap.add_argument("--steps", type=int, default=12, help="timed rounds (default 12)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--path", default=os.environ.get("SSDTRAIN_PATH") or tempfile.gettempdir())
    ns = ap.parse_args(argv)
    if ns.gbps <= 0 or ns.steps < 1:
        ap.error("--gbps must be > 0 and --steps >= 1")

    cfg = preset("default")
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    usual_allocations()

    cpus = os.cpu_count() or 1

    def step() -> tuple[float, float | None]:
        tokens = torch.randint(0, cfg.vocab, (ns.batch, cfg.seq))
        s0 = stolen_seconds()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        model(tokens, tokens).backward()
        opt.step()
        seconds = time.perf_counter() - t0
        s1 = stolen_seconds()
        return seconds, (None if s0 is None or s1 is None else (s1 - s0) / (seconds * cpus))

    quiet, busy, quiet_steal, busy_steal = [], [], [], []
    for r in range(1 + ns.steps):
        for mode in ("quiet", "busy") if r % 2 == 0 else ("busy", "quiet"):
            traffic = None
            if mode == "busy":
                traffic = subprocess.Popen([sys.executable, "-c", _TRAFFIC, str(ns.gbps), ns.path],
                                           stdout=subprocess.PIPE, text=True)
                if traffic.stdout.readline().strip() != "ready":
                    traffic.wait()
                    print(f"io_interference: the traffic process failed on {ns.path}", file=sys.stderr)
                    return 2
            seconds, steal = step()
            if traffic is not None:
                traffic.kill()
                traffic.wait()
            time.sleep(0.5)  # the killed process's memory goes back before the next step
            if r > 0:
                (busy if mode == "busy" else quiet).append(seconds)
                (busy_steal if mode == "busy" else quiet_steal).append(steal)
    ratios = [b / q for b, q in zip(busy, quiet)]
    print(f"baseline steps with {ns.gbps:.2f} GB/s of O_DIRECT traffic on {ns.path} in another process, "
          f"vs without ({ns.steps} rounds, alternating order)")
    print(f"median step: {statistics.median(quiet):.3f}s quiet, {statistics.median(busy):.3f}s with traffic")
    print(f"median of per-round ratios: {statistics.median(ratios):.3f}   "
          f"ratio of medians: {statistics.median(busy) / statistics.median(quiet):.3f}")
    print("per round: " + " ".join(f"{x:.3f}" for x in ratios))
    if None not in quiet_steal + busy_steal:  # Note [timing on a noisy machine] in ssdtrain/bench.py
        print(f"host steal (share of CPU time taken by the hypervisor), median per step: "
              f"{statistics.median(quiet_steal):.3f} quiet, {statistics.median(busy_steal):.3f} with traffic")
    return 0


if __name__ == "__main__":
    sys.exit(main())
