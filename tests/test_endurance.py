"""Endurance projection (ssdtrain/store/endurance.py) with a fake clock."""

from __future__ import annotations

import math
import threading

import pytest
import torch

import ssdtrain
from ssdtrain.config import OffloadConfig
from ssdtrain.store import endurance
from ssdtrain.store.endurance import EnduranceMonitor
from ssdtrain.store.posix import PosixBackend
from ssdtrain.store.throttle import ThrottledBackend

GB = 10**9
TB = 10**12
DAY = 86400


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_formulas():
    assert endurance.drive_writes_per_day(1 * TB / DAY, 2 * TB) == pytest.approx(0.5)
    assert endurance.days_to_rated_tbw(1 * TB / DAY, 600) == pytest.approx(600)
    assert endurance.days_to_rated_tbw(0, 600) == math.inf


def test_projection_per_path(tmp_path):
    clock = Clock()
    m = EnduranceMonitor([tmp_path], rated_tbw=1000, horizon_days=365, capacities=[4 * TB], clock=clock)
    clock.t += 100
    m.record(0, 200 * GB)  # 2 GB/s
    p = m.projection()
    assert p["elapsed_seconds"] == pytest.approx(100)
    (q,) = p["paths"]
    assert q["written_bytes"] == 200 * GB
    assert q["bytes_per_second"] == pytest.approx(2 * GB)
    assert q["drive_writes_per_day"] == pytest.approx(2 * GB * DAY / (4 * TB))
    assert q["days_to_rated_tbw"] == pytest.approx(1000 * TB / (2 * GB) / DAY)
    assert m.written_bytes() == {str(tmp_path): 200 * GB}


def test_warns_once_within_horizon(tmp_path):
    clock = Clock()
    m = EnduranceMonitor([tmp_path], rated_tbw=600, horizon_days=365, capacities=[2 * TB], clock=clock)
    m.record(0, 300 * GB)
    assert m.check() is None  # warm-up: too early to project
    clock.t += 100  # 3 GB/s -> 600 TB in ~2.3 days
    msg = m.check()
    assert msg is not None and "600 TBW" in msg and "2 days" in msg and str(tmp_path) in msg
    clock.t += 100
    m.record(0, 300 * GB)
    assert m.check() is None  # once


def test_no_warning_beyond_horizon_or_without_rating(tmp_path):
    clock = Clock()
    m = EnduranceMonitor([tmp_path], rated_tbw=600, horizon_days=30, capacities=[2 * TB], clock=clock)
    clock.t += 3600
    m.record(0, 10 * GB)  # ~2.8 MB/s -> centuries
    assert m.check() is None
    m2 = EnduranceMonitor([tmp_path], rated_tbw=None, capacities=[2 * TB], clock=clock)
    m2.record(0, 10**15)
    clock.t += 3600
    assert m2.check() is None
    assert m2.projection()["paths"][0]["days_to_rated_tbw"] is None


def test_paths_on_one_drive_add_up(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    clock = Clock()
    m = EnduranceMonitor([a, b], rated_tbw=100, horizon_days=10, capacities=[TB, TB], clock=clock)
    clock.t += 100
    m.record(0, 100 * GB)
    m.record(1, 100 * GB)
    pa, pb = m.projection()["paths"]
    assert pa["bytes_per_second"] == pytest.approx(1 * GB)
    assert pa["drive_bytes_per_second"] == pytest.approx(2 * GB)  # same filesystem: one drive
    assert pa["days_to_rated_tbw"] == pb["days_to_rated_tbw"]


def test_capacity_defaults_to_the_filesystem(tmp_path):
    from ssdtrain.store import _fs

    m = EnduranceMonitor([tmp_path])
    assert m.projection()["paths"][0]["capacity_bytes"] == _fs.total_bytes(tmp_path)


def test_record_is_thread_safe(tmp_path):
    m = EnduranceMonitor([tmp_path, tmp_path / "x"], capacities=[TB, TB])

    def work():
        for _ in range(10000):
            m.record(0, 1)
            m.record(1, 2)

    ts = [threading.Thread(target=work) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert list(m.written_bytes().values()) == [40000, 80000]


@pytest.mark.parametrize("kw", [dict(rated_tbw=0), dict(rated_tbw=-1), dict(horizon_days=0), dict(capacities=[1, 2])])
def test_bad_arguments(tmp_path, kw):
    with pytest.raises(ValueError):
        EnduranceMonitor([tmp_path], **kw)


def test_the_offloader_counts_every_byte_written_also_of_saves_that_died_meanwhile(tmp_path):
    """A save whose tensors died while its write was in flight (a forward without backward) still
    wore the drive: the projection counts what the offloader wrote, all of it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU())
                                  for _ in range(6)])
    x = torch.randn(512, 256)
    # 50 MB/s: each forward's ~6 MiB are still being written when its graph dies.
    store = ThrottledBackend(PosixBackend(OffloadConfig(path=str(tmp_path))), write_bps=50e6, read_bps=1e9)
    off = ssdtrain.Offloader(model, store=store, min_bytes=0)
    for _ in range(3):
        with off:
            model(x).sum()  # dropped at once: no backward
    off.wait()
    s = off.stats()
    assert s.written_bytes > 0
    assert [p["written_bytes"] for p in s.endurance["paths"]] == [s.written_bytes]
    off.close()
    store.close()
