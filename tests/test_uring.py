"""The posix backend's io_uring engine (Note [I/O without threads] in ``store/_uring.py``)."""

from __future__ import annotations

import mmap
import os
import threading

import pytest
import torch

import ssdtrain
import ssdtrain.store.posix as posix
from ssdtrain import OffloadConfig
from ssdtrain.models import GPT, GPTConfig
from ssdtrain.store import _uring as uring
from ssdtrain.store.posix import PosixBackend

from _equiv import assert_same, step

pytestmark = pytest.mark.skipif(not uring.available(), reason=f"io_uring: {uring.unavailable_reason()}")

MiB = 1 << 20


def _backend(off_dir, **cfg) -> PosixBackend:
    b = PosixBackend(OffloadConfig(path=str(off_dir), io_engine="uring", **cfg))
    if not b.direct:
        b.close()
        pytest.skip(f"{off_dir} does not take O_DIRECT")
    return b


def test_ring_round_trip_without_threads(off_dir, monkeypatch):
    b = _backend(off_dir, chunk_bytes="1MiB", io_threads=2)
    arena = b._arenas[0]
    tasks = []
    for pool in (arena.pool, arena.read_pool):
        monkeypatch.setattr(pool, "submit", lambda *a, **k: tasks.append(a))
    src = torch.randn(7 * MiB // 8 // 2 + 3, dtype=torch.float64).view(torch.uint8).reshape(-1)
    extent = b.allocate(src.numel())
    fut = b.submit_write(extent, src)
    assert b.needs_poll()
    assert fut.result() == [None] * 4  # 3.5 MiB + lead in 1 MiB windows; result() drives the ring
    dst = b.alloc_buffer(src.numel(), src.device, extent=extent)
    assert b.submit_read(extent, dst).exception(timeout=30) is None  # the polling path of a timed wait
    assert torch.equal(dst, src) and tasks == []
    assert not b.needs_poll()
    b.free(extent)
    b.close()


def test_a_full_ring_waits_and_nothing_is_lost(tmp_path):
    """More operations than the ring has entries, submitted at once: submit waits for room
    (without running callbacks), and every completion is handed over exactly once."""
    done = []
    ring = uring.Ring(4, lambda token, res: done.append((token, res)))
    assert ring.entries == 4
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT | os.O_DIRECT)
    buf = mmap.mmap(-1, 64 * 4096)
    for i in range(64):
        buf[i * 4096:(i + 1) * 4096] = bytes([i]) * 4096
    addr = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
    ring.submit([(uring.OP_WRITE, fd, addr + i * 4096, 4096, i * 4096, i) for i in range(64)])
    assert len(done) < 64  # submit ran no callback; they wait for poll/wait
    while ring.in_flight or ring.has_ready():
        ring.wait()
    assert sorted(done) == [(i, 4096) for i in range(64)]
    back = os.pread(os.open(tmp_path / "f", os.O_RDONLY), 64 * 4096, 0)
    assert back == bytes(buf)
    os.close(fd)
    ring.close()
    buf.close()


def test_refused_submission_is_an_error_not_a_hang(tmp_path):
    ring = uring.Ring(8)
    buf = mmap.mmap(-1, 4096)
    addr = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
    got = []
    ring._on_complete = lambda token, res: got.append(res)
    ring.submit([(uring.OP_WRITE, 987654, addr, 4096, 0, "bad fd")])  # the kernel answers -EBADF
    ring.wait()
    assert got and got[0] < 0
    assert ring.in_flight == 0
    ring.close()
    buf.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_short_completions_are_finished_with_another_request(off_dir, monkeypatch, dtype):
    """A completion that moved only part of its window: the rest is submitted again, and the
    gradients are still exact (the bytes that arrive are the same ones)."""
    seen = {"short": 0}

    def half(op, res, length):
        if res == length and length >= 2 * 4096 and seen["short"] < 50:
            seen["short"] += 1
            return (length // 2) // 4096 * 4096
        return res

    monkeypatch.setattr(posix, "_ring_result", half)
    torch.manual_seed(0)
    # Attention with s x s scores, dropout, layer norm, views of one QKV storage; in bfloat16 the
    # loss is still taken in float32 (mixed dtypes).
    model = GPT(GPTConfig(vocab=256, seq=64, layers=3, hidden=64, heads=4, dropout=0.1, flash=False)).to(dtype)
    tok = torch.randint(0, 256, (4, 64))
    base = step(model, lambda: model(tok, tok), None)
    off = ssdtrain.Offloader(model, path=str(off_dir), min_bytes=0, io_engine="uring", chunk_bytes="64KiB")
    assert off._backend._ring is not None
    assert_same(base, step(model, lambda: model(tok, tok), off, wait=True))
    s = off.stats()
    assert seen["short"] > 0 and s.reads > 0 and s.written_bytes > 0
    off.close()


def test_threads_and_the_ring_share_one_backend(off_dir):
    """Several threads write and read back through the same ring at once."""
    b = _backend(off_dir, chunk_bytes="64KiB")
    errors = []

    def worker(seed):
        try:
            g = torch.Generator().manual_seed(seed)
            for n in (4096, 100_000, 300_001):
                src = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
                extent = b.allocate(n)
                b.submit_write(extent, src).result()
                dst = b.alloc_buffer(n, src.device, extent=extent)
                b.submit_read(extent, dst).result()
                assert torch.equal(dst, src)
                b.free(extent)
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and not any(t.is_alive() for t in threads)
    b.close()


def test_close_completes_what_is_in_flight(off_dir):
    b = _backend(off_dir)
    src = torch.randint(0, 256, (3 * MiB,), dtype=torch.uint8)
    fut = b.submit_write(b.allocate(src.numel()), src)
    b.close()
    assert fut.done() and fut.exception() is None


def test_uring_asked_for_where_it_cannot_work_is_refused(off_dir):
    with pytest.raises(ValueError, match="io_engine='uring' cannot be used.*O_DIRECT"):
        PosixBackend(OffloadConfig(path=str(off_dir), io_engine="uring", direct_io=False))
    with pytest.raises(ValueError, match="io_engine='fast' is not one of"):
        OffloadConfig(io_engine="fast")
    b = PosixBackend(OffloadConfig(path=str(off_dir), io_engine="threads"))
    assert b._ring is None
    b.close()
