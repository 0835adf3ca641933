"""What a rank of the two-rank callback tests (``_trainer_ddp_worker.py``, ``_lightning_ddp_worker.py``)
reports: ``torch.equal`` of the trained parameters with and without offloading, and the offloader's
traces."""

from __future__ import annotations

import contextlib
import json
import os

import torch

import ssdtrain


@contextlib.contextmanager
def counted_entries():
    """Yields a list that gets, for each ``with offloader:`` entry (any offloader), whether
    gradients were enabled."""
    entries: list[bool] = []
    enter = ssdtrain.Offloader.__enter__

    def counting(self):
        entries.append(torch.is_grad_enabled())
        return enter(self)

    ssdtrain.Offloader.__enter__ = counting
    try:
        yield entries
    finally:
        ssdtrain.Offloader.__enter__ = enter


def write(out_dir: str, *, want: dict, got: dict, start: dict, entries: list, stats, act_dir: str, **extra) -> None:
    """Writes ``rank<RANK>.json``: the parameters not ``torch.equal`` between the runs with and
    without offloading (``got``, ``want``), whether training changed them from ``start``, the
    entries, the bytes written and read, and the files left in ``act_dir``."""
    report = {
        **extra,
        "differ": [n for n in want if not torch.equal(got[n], want[n])],
        "trained": any(not torch.equal(want[n], start[n]) for n in want),
        "entries": entries,
        "written_bytes": stats.written_bytes,
        "read_bytes": stats.read_bytes,
        "left_behind": [f for _, _, fs in os.walk(act_dir) for f in fs],
    }
    with open(os.path.join(out_dir, f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump(report, f)
