"""The kvikio backend (ssdtrain/store/kvikio_backend.py) against real kvikio.

kvikio loads the CUDA driver library for any I/O, even on host memory. Where there is none (CI
has no GPU), the ``cuda_driver`` fixture builds the test-only stand-in in tests/_fake_cuda/ with
the system C compiler and loads it under the driver's name, ``libcuda.so.1``: every call answers
"not initialised", which kvikio takes to mean host memory, served by its POSIX path.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import pathlib
import shutil
import subprocess
import sys
import time

import pytest
import torch

from ssdtrain.config import OffloadConfig
from ssdtrain.store import _arena
from ssdtrain.store.base import ALIGN, ChecksumError, StorageError

FAKE_CUDA = pathlib.Path(__file__).parent / "_fake_cuda" / "libcuda.c"
MESSAGE = "kvikio is not installed; pip install 'ssdtrain[kvikio]'"


def test_missing_kvikio_is_one_clear_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "kvikio", None)
    monkeypatch.setitem(sys.modules, "kvikio.defaults", None)
    monkeypatch.delitem(sys.modules, "ssdtrain.store.kvikio_backend", raising=False)
    with pytest.raises(ImportError) as info:
        importlib.import_module("ssdtrain.store.kvikio_backend")
    assert str(info.value) == MESSAGE
    assert info.value.__suppress_context__  # no chained traceback
    from ssdtrain.store import make_backend

    with pytest.raises(ImportError, match=r"pip install 'ssdtrain\[kvikio\]'"):
        make_backend(OffloadConfig(path="/tmp", backend="kvikio"))


def build_stand_in(out_dir: pathlib.Path) -> pathlib.Path:
    """Compiles the stand-in driver; returns the library's path."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler to build the stand-in CUDA driver")
    lib = out_dir / "libcuda.so.1"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-Wl,-soname,libcuda.so.1", "-o", str(lib), str(FAKE_CUDA)],
                   check=True, capture_output=True)
    return lib


@pytest.fixture(scope="module")
def cuda_driver(tmp_path_factory):
    pytest.importorskip("kvikio")
    try:
        ctypes.CDLL("libcuda.so.1")
        return "real"  # a machine with the CUDA driver: use it
    except OSError:
        pass
    lib = build_stand_in(tmp_path_factory.mktemp("fake_cuda"))
    # Loaded first under its soname, the stand-in is what kvikio's dlopen("libcuda.so.1") finds.
    ctypes.CDLL(str(lib), mode=os.RTLD_GLOBAL)
    return "stand-in"


@pytest.fixture
def make(cuda_driver, tmp_path):
    from ssdtrain.store.kvikio_backend import KvikioBackend

    made = []

    def make(paths=None, **kw):
        cfg = OffloadConfig(path=paths or [str(tmp_path / "a")], backend="kvikio", **kw)
        b = KvikioBackend(cfg)
        made.append(b)
        return b

    yield make
    for b in made:
        b.close()


def _bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("n", [1, 4095, 4096, 5000, (3 << 20) + 7])
@pytest.mark.parametrize("skew", [0, 1, 64])
def test_roundtrip_exact(make, n, skew):
    b = make(chunk_bytes="1MiB")
    src = _bytes(n + skew, n)[skew:]  # misaligned views of ordinary tensors too
    e = b.allocate(n)
    assert e.offset % ALIGN == 0 and e.length % ALIGN == 0
    b.submit_write(e, src).result()
    for dst in (b.alloc_buffer(n, torch.device("cpu"), extent=e), torch.zeros(n, dtype=torch.uint8)):
        b.submit_read(e, dst).result()
        assert torch.equal(dst, src)
    b.free(e)


def test_read_buffers_come_back_for_reuse(make):
    b = make()
    src = _bytes(1 << 20, 1)
    e = b.allocate(src.numel())
    b.submit_write(e, src).result()
    for _ in range(3):
        dst = b.alloc_buffer(src.numel(), torch.device("cpu"), extent=e)
        b.submit_read(e, dst).result()
        assert torch.equal(dst, src)
        del dst
    assert b._pool.created == 1 and b._pool.reused == 2


def test_two_paths_both_used_and_exact(make, tmp_path):
    b = make([str(tmp_path / "a"), str(tmp_path / "b")], io_threads=2)
    srcs = [_bytes(300_000 + i, i) for i in range(8)]
    extents = [b.allocate(s.numel()) for s in srcs]
    for f in [b.submit_write(e, s) for e, s in zip(extents, srcs)]:
        f.result()
    assert {e.path_index for e in extents} == {0, 1}
    written = b.written_bytes_by_path()
    assert all(v > 0 for v in written.values()) and sum(written.values()) == sum(s.numel() for s in srcs)
    bufs = [b.alloc_buffer(s.numel(), torch.device("cpu"), extent=e) for s, e in zip(srcs, extents)]
    for f in [b.submit_read(e, d) for e, d in zip(extents, bufs)]:
        f.result()
    assert all(torch.equal(s, d) for s, d in zip(srcs, bufs))


def test_checksum_catches_a_flipped_byte(make):
    b = make()
    src = _bytes(10_000, 3)
    e = b.allocate(src.numel())
    record = b.submit_write(e, src, checksum=True).result()
    assert record is not None
    dst = b.alloc_buffer(src.numel(), torch.device("cpu"), extent=e)
    b.submit_read(e, dst, checksum=record).result()
    arena = b._arenas[e.path_index]
    pos = e.offset + arena.leads[e.offset] + 1234
    os.pwrite(arena.file.fileno(), bytes([src[1234].item() ^ 0xFF]), pos)
    os.fsync(arena.file.fileno())
    with pytest.raises(ChecksumError, match="checksum mismatch"):
        b.submit_read(e, b.alloc_buffer(src.numel(), torch.device("cpu"), extent=e), checksum=record).result()


def test_reading_what_was_never_written_fails(make):
    b = make()
    e = b.allocate(1 << 16)  # beyond the end of the (empty) arena file
    with pytest.raises(StorageError, match="kvikio read"):
        b.submit_read(e, torch.empty(1 << 16, dtype=torch.uint8)).result()


def test_fences_run_before_io(make):
    b = make()
    order = []
    src = _bytes(8192, 4)
    e = b.allocate(src.numel())
    b.submit_write(e, src, ready=lambda: order.append("write fence")).result()
    dst = b.alloc_buffer(src.numel(), torch.device("cpu"), extent=e)
    b.submit_read(e, dst, ready=lambda: order.append("read fence")).result()
    assert order == ["write fence", "read fence"] and torch.equal(dst, src)


def test_settings_files_and_close(make, tmp_path, cuda_driver):
    import kvikio.defaults

    b = make([str(tmp_path / "a"), str(tmp_path / "b")], io_threads=3, chunk_bytes="2MiB")
    assert kvikio.defaults.get("num_threads") >= 6
    assert b.task_size == 2 << 20
    assert b.describe().startswith("kvikio (")
    if cuda_driver == "stand-in":
        assert "compat" in b.describe() and not b.gds
    assert os.listdir(tmp_path / "a") == [] and os.listdir(tmp_path / "b") == []  # opened, then unlinked
    b.close()
    b.close()


def test_space_that_stays_free_is_punched(make, monkeypatch):
    monkeypatch.setattr(_arena, "TRIM_AFTER_SECONDS", 0.0)
    b = make()
    src = _bytes(1 << 20, 5)
    keep, drop = b.allocate(src.numel()), b.allocate(src.numel())
    for e in (keep, drop):
        b.submit_write(e, src).result()
    arena = b._arenas[0]
    before = os.fstat(arena.file.fileno()).st_blocks
    b.free(drop)
    deadline = time.monotonic() + 10
    while (arena.trimming or arena.alloc.untrimmed_bytes) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert arena.alloc.untrimmed_bytes == 0 and not arena.trimming
    after = os.fstat(arena.file.fileno()).st_blocks
    assert after <= before - (1 << 20) // 512 or not _punch_works(arena.path)
    dst = b.alloc_buffer(src.numel(), torch.device("cpu"), extent=keep)
    b.submit_read(keep, dst).result()
    assert torch.equal(dst, src)


def _punch_works(path: str) -> bool:
    from ssdtrain.store import _fs

    fd = os.open(os.path.join(path, ".punch-check"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.write(fd, b"x" * 8192)
        return _fs.punch_hole(fd, 0, 4096)
    finally:
        os.close(fd)
        os.unlink(os.path.join(path, ".punch-check"))


def test_offloader_gradients_equal_through_kvikio(cuda_driver, tmp_path):
    import ssdtrain

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64), torch.nn.Tanh())
    x = torch.randn(128, 64)

    model(x).square().sum().backward()
    want = [p.grad.clone() for p in model.parameters()]
    off = ssdtrain.Offloader(model, path=str(tmp_path), backend="kvikio", min_bytes=0)
    try:
        for _ in range(2):
            model.zero_grad()
            with off:
                loss = model(x).square().sum()
            off.wait()
            loss.backward()
            got = [p.grad.clone() for p in model.parameters()]
            assert all(torch.equal(a, b) for a, b in zip(want, got))
        s = off.stats()
        assert off.backend == "kvikio" and s.written_bytes > 0 and s.read_bytes > 0
    finally:
        off.close()
    assert os.listdir(tmp_path) == []
