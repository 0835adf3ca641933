"""What moving the offloader's bytes costs compute on this machine, without the offloader.

Trains the step-time benchmark's decoder with no offloading at all, alternating rounds in which a
separate process reads and writes a file with O_DIRECT at a fixed rate (by default what the
offloader moves in that benchmark: about 1.04 GB per ~2.4 s step). The ratio of the two step
times is the price the machine charges for that traffic alone (interrupts, the hypervisor's
block path, threads waking up on busy cores), the floor under ``step_time.py``'s ratio. With
``--offload``, offloaded steps (the default config) join the same rounds; their ratio to the
steps with traffic is what the offloader costs beyond moving its bytes.

Usage::

    python benchmarks/io_interference.py                      # 0.43 GB/s to $SSDTRAIN_PATH or /tmp
    python benchmarks/io_interference.py --gbps 0.2 --steps 16 --path /nvme
    python benchmarks/io_interference.py --offload            # offloaded steps in the same rounds
    python benchmarks/io_interference.py --huge-pages         # the same traffic from huge pages too
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import ssdtrain
from ssdtrain._measure import stolen_seconds, usual_allocations
from ssdtrain.models import GPT, GPTConfig, preset

# The traffic: half writes, half reads, in 8 MiB requests over a 512 MiB region, paced. Its
# buffer is on 4 KiB pages (shared memory, which THP leaves alone), as torch's tensors are, or
# with "huge" on 2 MiB transparent huge pages, as the offloader's reload buffers are: the same
# bytes then reach the drive in fewer, larger requests with fewer segments each.
_TRAFFIC = r"""
import mmap, os, sys, tempfile, time
from ssdtrain.store._hostbuf import HostMapping
gbps, path, pages = float(sys.argv[1]), sys.argv[2], sys.argv[3]
chunk, size = 8 << 20, 512 << 20
fd, name = tempfile.mkstemp(dir=path)
os.close(fd)
fd = os.open(name, os.O_RDWR | getattr(os, "O_DIRECT", 0))
os.unlink(name)
if pages == "huge":
    m = HostMapping(size)  # the reload buffers' mapping: huge-page aligned, MADV_HUGEPAGE
    buf, start = m.mm, m.start
else:
    buf, start = mmap.mmap(-1, size), 0
mv = memoryview(buf)[start:start + size]
mv[:] = b"\x5a" * size
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


_LABEL = {"quiet": "quiet", "busy": "with traffic", "busy-huge": "with traffic from huge pages",
          "offload": "offloaded"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gbps", type=float, default=0.43, help="background traffic, GB/s (default 0.43)")
    ap.add_argument("--steps", type=int, default=12, help="timed rounds (default 12)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--path", default=os.environ.get("SSDTRAIN_PATH") or tempfile.gettempdir())
    ap.add_argument("--tiny", action="store_true", help="8 tiny layers: a smoke run (what the tests run)")
    ap.add_argument("--offload", action="store_true",
                    help="also run offloaded steps (default config, to --path) in the same rounds: "
                         "their cost beside the traffic's")
    ap.add_argument("--huge-pages", action="store_true",
                    help="also run steps with the same traffic from a buffer on transparent huge pages: "
                         "what the size of the physical pages under the I/O costs")
    ns = ap.parse_args(argv)
    if ns.gbps <= 0 or ns.steps < 1:
        ap.error("--gbps must be > 0 and --steps >= 1")

    cfg = GPTConfig(vocab=256, seq=64, layers=8, hidden=64, heads=4) if ns.tiny else preset("default")
    torch.manual_seed(0)
    model = GPT(cfg)
    # Each mode trains its own copy: the same compute, and no offloader hooks on the baseline.
    copies = {"quiet": model, "busy": copy.deepcopy(model)}
    if ns.huge_pages:
        copies["busy-huge"] = copy.deepcopy(model)
    if ns.offload:
        copies["offload"] = copy.deepcopy(model)
    opts = {name: torch.optim.AdamW(m.parameters(), lr=1e-3) for name, m in copies.items()}
    off = ssdtrain.Offloader(copies["offload"], path=ns.path) if ns.offload else None
    usual_allocations()
    cpus = os.cpu_count() or 1

    def step(name: str, tokens: torch.Tensor) -> tuple[float, float | None]:
        m, opt = copies[name], opts[name]
        s0 = stolen_seconds()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        if name == "offload":
            with off:
                loss = m(tokens, tokens)
            loss.backward()
            off.wait()
        else:
            m(tokens, tokens).backward()
        opt.step()
        seconds = time.perf_counter() - t0
        s1 = stolen_seconds()
        return seconds, (None if s0 is None or s1 is None else (s1 - s0) / (seconds * cpus))

    names = list(copies)
    times: dict[str, list[float]] = {n: [] for n in names}
    steals: dict[str, list[float | None]] = {n: [] for n in names}
    try:
        for r in range(1 + ns.steps):
            tokens = torch.randint(0, cfg.vocab, (ns.batch, cfg.seq))
            for name in names if r % 2 == 0 else reversed(names):
                traffic = None
                if name.startswith("busy"):
                    pages = "huge" if name == "busy-huge" else "small"
                    traffic = subprocess.Popen([sys.executable, "-c", _TRAFFIC, str(ns.gbps), ns.path, pages],
                                               stdout=subprocess.PIPE, text=True)
                    if traffic.stdout.readline().strip() != "ready":
                        traffic.wait()
                        traffic.stdout.close()
                        print(f"io_interference: the traffic process failed on {ns.path}", file=sys.stderr)
                        return 2
                seconds, steal = step(name, tokens)
                if traffic is not None:
                    traffic.kill()
                    traffic.wait()
                    traffic.stdout.close()
                time.sleep(0.5)  # the killed process's memory goes back before the next step
                if r > 0:
                    times[name].append(seconds)
                    steals[name].append(steal)
    finally:
        if off is not None:
            off.close()

    quiet = times["quiet"]
    print(f"baseline steps with {ns.gbps:.2f} GB/s of O_DIRECT traffic on {ns.path} in another process, "
          f"vs without ({ns.steps} rounds, alternating order)")
    print("median step: " + ", ".join(f"{statistics.median(times[n]):.3f}s {_LABEL[n]}" for n in names))
    for n in names[1:]:
        ratios = [x / q for x, q in zip(times[n], quiet)]
        print(f"{_LABEL[n]} / quiet: median of per-round ratios {statistics.median(ratios):.3f}   "
              f"ratio of medians {statistics.median(times[n]) / statistics.median(quiet):.3f}")
        print("  per round: " + " ".join(f"{x:.3f}" for x in ratios))
    if ns.huge_pages:
        ratios = [h / b for h, b in zip(times["busy-huge"], times["busy"])]
        print(f"with traffic from huge pages / from small pages: median of per-round ratios "
              f"{statistics.median(ratios):.3f}")
    if ns.offload:
        ratios = [o / b for o, b in zip(times["offload"], times["busy"])]
        print(f"offloaded / with traffic (the offloader's own share): median of per-round ratios "
              f"{statistics.median(ratios):.3f}")
    if all(None not in v for v in steals.values()):  # Note [timing on a noisy machine] in ssdtrain/bench.py
        print("host steal (share of CPU time taken by the hypervisor), median per step: "
              + ", ".join(f"{statistics.median(steals[n]):.3f} {_LABEL[n]}" for n in names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
