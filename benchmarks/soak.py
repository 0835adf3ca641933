"""Soak: many small offloaded steps; descriptors, threads, RSS and arena disk use must stay flat.

Usage::

    python benchmarks/soak.py                 # 1000 steps in the temp dir
    python benchmarks/soak.py --steps 200 --path /nvme

Prints a line every ``--every`` steps and exits 1 if anything grew past its bound between the
report half-way and the last. The test suite runs 200 steps of the same loop
(``tests/test_hardening.py::test_soak_stays_flat``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading

import torch
from torch import nn

import ssdtrain


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _arena_bytes(path: str) -> int:
    """Disk blocks of the arena files this process holds open under ``path`` (unlinked files,
    found through /proc/self/fd)."""
    root = os.path.realpath(path)
    seen, total = set(), 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
            st = os.fstat(int(fd))
        except OSError:
            continue
        if target.startswith(root + os.sep) and (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
    return total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--every", type=int, default=100)
    ap.add_argument("--path", default=tempfile.gettempdir())
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(128, 128), nn.Tanh()) for _ in range(4)])
    x = torch.randn(32, 128)
    off = ssdtrain.Offloader(model, path=args.path, min_bytes=0)
    rows = []
    for i in range(1, args.steps + 1):
        with off:
            loss = model(x).sum()
        loss.backward()
        if i % args.every == 0:
            off.wait()
            row = (i, len(os.listdir("/proc/self/fd")), threading.active_count(), _rss(),
                   _arena_bytes(args.path), off.stats().live_disk_bytes)
            rows.append(row)
            print("step %5d  fds %3d  threads %2d  rss %7.1f MiB  arena %7.1f KiB  live disk %d B" % (
                row[0], row[1], row[2], row[3] / 2**20, row[4] / 1024, row[5]), flush=True)
    off.close()
    # Warm-up (pools, allocator placement, a burst's high-water mark) happens in the first half;
    # the second half must be flat.
    first, last = rows[len(rows) // 2], rows[-1]
    ok = (last[1] <= first[1] and last[2] <= first[2] + 2 * off.config.io_threads
          and last[3] - first[3] < 32 << 20 and last[4] <= 2 * first[4] + (256 << 10) and last[5] == 0)
    print("flat" if ok else "GREW", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
