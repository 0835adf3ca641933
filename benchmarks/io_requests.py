"""Per training step: the drive's requests and who was woken or preempted for them.

Trains the bench model (``ssdtrain bench``'s default, or ``--tiny``) for a few steps, offloaded
with the config given (or not at all with ``--baseline``), and prints per step, averaged over the
measured steps:

* read and write requests the offload path's block device completed, and their mean size
  (``/sys/dev/block/MAJ:MIN/stat`` of the device holding ``--path``);
* the training thread's voluntary and involuntary context switches (``/proc/self/task``);
* the threads of the whole machine with the most context switches (kernel workers included:
  on a virtio disk the block layer's ``kblockd`` restarts requests that do not fit its queue);
* the process's page faults and user and system CPU time, and how many of the huge-page
  allocator's allocations reused a freed block (Note [reuse freed blocks] in
  ``cuda_ext/ssdtrain_hostalloc.cpp``).

Usage::

    python benchmarks/io_requests.py                                   # default config
    python benchmarks/io_requests.py --config '{"host_allocator": "torch"}'
    python benchmarks/io_requests.py --baseline

Counts are for the whole device: run nothing else on it meanwhile.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import resource
import sys
import tempfile

import torch

import ssdtrain
from ssdtrain import _hostalloc
from ssdtrain.models import GPT, GPTConfig, preset


def device_stat(path: str) -> list[int] | None:
    """The block device's I/O counters (reads, ..., writes, ...) for the filesystem of ``path``."""
    st = os.stat(path)
    stat = f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/stat"
    try:
        with open(stat) as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return None  # not a block device (tmpfs, overlay, network)


def switches() -> dict[str, tuple[str, int, int]]:
    """Every thread of the machine: (name, voluntary, involuntary context switches)."""
    out = {}
    for status in glob.glob("/proc/[0-9]*/task/[0-9]*/status"):
        try:
            with open(status) as f:
                text = f.read()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
        out[status] = (fields["Name"].strip(), int(fields.get("voluntary_ctxt_switches", 0)),
                       int(fields.get("nonvoluntary_ctxt_switches", 0)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="{}", help="OffloadConfig fields as JSON (default: the default config)")
    ap.add_argument("--baseline", action="store_true", help="no offloading")
    ap.add_argument("--path", default=os.environ.get("SSDTRAIN_PATH", tempfile.gettempdir()))
    ap.add_argument("--steps", type=int, default=4, help="measured steps (after 2 warm-up steps)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tiny", action="store_true", help="a small model: seconds")
    ns = ap.parse_args(argv)

    cfg = GPTConfig(vocab=256, seq=64, layers=8, hidden=64, heads=4) if ns.tiny else preset("default")
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    off = None if ns.baseline else ssdtrain.Offloader(model, path=ns.path, **json.loads(ns.config))

    def step() -> None:
        tokens = torch.randint(0, cfg.vocab, (ns.batch, cfg.seq))
        opt.zero_grad(set_to_none=True)
        if off is not None:
            with off:
                loss = model(tokens, tokens)
        else:
            loss = model(tokens, tokens)
        loss.backward()
        if off is not None:
            off.wait()
        opt.step()

    for _ in range(2):
        step()
    dev0, sw0 = device_stat(ns.path), switches()
    ru0, ha0 = resource.getrusage(resource.RUSAGE_SELF), _hostalloc.counters()
    for _ in range(ns.steps):
        step()
    ru1, ha1 = resource.getrusage(resource.RUSAGE_SELF), _hostalloc.counters()
    dev1, sw1 = device_stat(ns.path), switches()
    n = ns.steps
    print(f"mode: {'baseline' if off is None else 'offload'}"
          + ("" if off is None else f", host allocator {off.host_allocator}, {off.stats().backend}"))
    if dev0 and dev1:
        d = [b - a for a, b in zip(dev0, dev1)]
        print(f"per step: {d[0] / n:.0f} read requests ({d[2] * 512 / max(d[0], 1) / 2**20:.2f} MiB each), "
              f"{d[4] / n:.0f} write requests ({d[6] * 512 / max(d[4], 1) / 2**20:.2f} MiB each)")
    else:
        print(f"per step: {ns.path} is not on a block device; no request counts")
    me = f"/proc/{os.getpid()}/task/{os.getpid()}/status"
    total = collections.Counter()
    for key, (name, vol, invol) in sw1.items():
        _, vol0, invol0 = sw0.get(key, (name, 0, 0))
        who = "training thread" if key == me else (f"this process: {name}" if f"/proc/{os.getpid()}/" in key else name)
        total[(who, "voluntary")] += (vol - vol0) / n
        total[(who, "involuntary")] += (invol - invol0) / n
    print(f"per step: {(ru1.ru_minflt - ru0.ru_minflt) / n:.0f} page faults, "
          f"{(ru1.ru_utime - ru0.ru_utime) / n:.3f} s user and {(ru1.ru_stime - ru0.ru_stime) / n:.3f} s system CPU "
          f"(all threads); huge-page allocator: {(ha1['allocations'] - ha0['allocations']) / n:.0f} allocations, "
          f"{(ha1['reused'] - ha0['reused']) / n:.0f} of them reused a freed block")
    print("context switches per step (top 6):")
    for (who, kind), count in total.most_common(6):
        print(f"  {who:<40} {kind:<12} {count:8.0f}")
    if off is not None:
        off.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
