"""The kvikio backend (ssdtrain/store/kvikio_backend.py) against real kvikio, and how ``auto``
chooses it (ssdtrain/store/__init__.py).

kvikio loads the CUDA driver library for any I/O, even on host memory. Where there is none (CI
has no GPU), the ``cuda_driver`` fixture builds the test-only stand-in in tests/_fake_cuda/ with
the system C compiler and loads it under the driver's name, ``libcuda.so.1``: every call answers
"not initialised", which kvikio takes to mean host memory, served by its POSIX path.

The CUDA paths (GDS, and compat mode's pinned staging) run for real only on a GPU
(tests/gpu/); here their windowing, ordering and checksum logic runs on host tensors that the
``pretend_cuda`` fixture makes the backend take for device memory.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import sys
import threading
import time
import types

import pytest
import torch
from _fake_cuda import load_driver

from ssdtrain.config import OffloadConfig
from ssdtrain.store import _arena
from ssdtrain.store.base import ALIGN, ChecksumError, StorageError

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


def _kvikio_modules() -> dict:
    return {k: v for k, v in sys.modules.items()
            if k == "kvikio" or k.startswith("kvikio.") or k == "ssdtrain.store.kvikio_backend"}


@pytest.fixture
def fake_kvikio(monkeypatch, tmp_path):
    """Installs a stand-in ``kvikio`` package whose ``__init__`` is the given source; the real
    modules (imported or not) are back afterwards."""
    before = _kvikio_modules()

    def install(init: str, defaults: str = "") -> None:
        pkg = tmp_path / "fake_site" / "kvikio"
        pkg.mkdir(parents=True)
        (pkg / "__init__.py").write_text(init)
        (pkg / "defaults.py").write_text(defaults)
        monkeypatch.syspath_prepend(str(pkg.parent))
        for name in _kvikio_modules():
            del sys.modules[name]
        importlib.invalidate_caches()

    yield install
    for name in _kvikio_modules():
        del sys.modules[name]
    sys.modules.update(before)


def test_a_kvikio_that_cannot_load_says_why(fake_kvikio, monkeypatch, tmp_path, caplog):
    fake_kvikio('raise OSError("libkvikio.so: cannot open shared object file: No such file or directory")\n')
    with pytest.raises(ImportError, match="installed but cannot be imported.*libkvikio.so: cannot open") as info:
        importlib.import_module("ssdtrain.store.kvikio_backend")
    assert "not installed" not in str(info.value)
    # Under auto, with a GPU, the same cause is what stats().backend reports.
    from ssdtrain.store import backend_choice, make_backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    name, why = backend_choice(OffloadConfig(path=str(tmp_path), backend="auto"))
    assert name == "posix" and "libkvikio.so: cannot open" in why
    with caplog.at_level(logging.WARNING, logger="ssdtrain.store"):
        b = make_backend(OffloadConfig(path=str(tmp_path), backend="auto"))
    try:
        assert b.name == "posix" and "libkvikio.so: cannot open" in b.describe()
    finally:
        b.close()
    assert any("kvikio is installed but cannot be used" in r.getMessage() for r in caplog.records)


def test_a_kvikio_older_than_25_12_is_refused(fake_kvikio, monkeypatch, tmp_path):
    fake_kvikio('__version__ = "25.10.00"\n')
    with pytest.raises(ImportError, match=r"kvikio 25.10.00 is too old: ssdtrain needs kvikio 25.12"):
        importlib.import_module("ssdtrain.store.kvikio_backend")
    from ssdtrain.store import backend_choice

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    name, why = backend_choice(OffloadConfig(path=str(tmp_path), backend="auto"))
    assert name == "posix" and "too old" in why


def test_auto_without_a_gpu_is_posix_and_says_so(tmp_path):
    import ssdtrain
    from ssdtrain.store import backend_choice, choose_backend

    cfg = OffloadConfig(path=str(tmp_path), backend="auto")
    assert backend_choice(cfg) == ("posix", "no CUDA device") and choose_backend(cfg) == "posix"
    assert backend_choice(OffloadConfig(path=str(tmp_path), backend="memory")) == ("memory", "asked for")
    off = ssdtrain.Offloader(path=str(tmp_path), backend="auto", min_bytes=0)
    try:
        assert off.backend == "posix" and "[auto: no CUDA device]" in off.stats().backend  # (a CUDA build adds the host tier)
    finally:
        off.close()


@pytest.fixture(scope="module")
def cuda_driver(tmp_path_factory):
    pytest.importorskip("kvikio")
    return load_driver(tmp_path_factory.mktemp("fake_cuda"))


def test_auto_with_a_gpu_but_no_gds_is_posix(cuda_driver, monkeypatch, tmp_path):
    # Note [auto picks kvikio only with GDS]
    from ssdtrain.store import backend_choice, make_backend
    from ssdtrain.store.kvikio_backend import gds_status

    gds, why = gds_status()
    if gds:
        pytest.skip("this machine has GPUDirect Storage")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = OffloadConfig(path=str(tmp_path), backend="auto")
    assert backend_choice(cfg) == ("posix", f"no GPUDirect Storage: {why}")
    b = make_backend(cfg)
    try:
        assert b.name == "posix" and why in b.describe()
    finally:
        b.close()


def test_auto_leaves_kvikio_when_a_path_is_not_served_by_gds(cuda_driver, monkeypatch, tmp_path):
    from ssdtrain.store import kvikio_backend, make_backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kvikio_backend, "gds_status", lambda: (True, "GPUDirect Storage (nvidia_fs 2.26)"))
    b = make_backend(OffloadConfig(path=str(tmp_path), backend="auto"))
    try:
        # Either the file system is not one GDS serves, or cuFile (absent here) refused the file.
        d = b.describe()
        assert b.name == "posix" and "no GPUDirect Storage" in d
        assert "which GPUDirect Storage does not serve" in d or "cuFile cannot register the arena file" in d, d
    finally:
        b.close()


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


def test_describe_says_compat_and_why(make, cuda_driver):
    from ssdtrain.store.kvikio_backend import gds_status

    b = make()
    if cuda_driver == "stand-in":
        assert not b.gds and b.describe().startswith(f"kvikio (compat: {gds_status()[1]}; CUDA tensors staged")


# -- the CUDA paths' logic, on host tensors the backend takes for device memory -----------------
class _Stream:
    cuda_stream = 0


@pytest.fixture
def pretend_cuda(monkeypatch):
    """Host tensors registered here look like CUDA tensors to the kvikio backend; the device
    functions it calls for them copy on the host and record what they were asked to do."""
    from ssdtrain.store import kvikio_backend

    dev = kvikio_backend.device
    marked: set[int] = set()
    log: list = []
    local = threading.local()

    def order(ready, stream):
        log.append("order")
        if ready is not None:
            ready()

    def copy(dst, src, *, after=None):
        order(after, None)
        dst.copy_(src)

    def queue_copy(dst, src, stream, event=None):
        dst.copy_(src)
        return event or types.SimpleNamespace(synchronize=lambda: log.append("wait copy"))

    def staging(n):
        buf = getattr(local, "buf", None)
        if buf is None or buf.numel() < n:
            block = torch.empty(n + 2 * ALIGN, dtype=torch.uint8)
            buf = local.buf = block[-block.data_ptr() % ALIGN:][:n + ALIGN]
        return buf

    monkeypatch.setattr(dev, "is_cuda", lambda t: t.untyped_storage().data_ptr() in marked)
    monkeypatch.setattr(dev, "order", order)
    monkeypatch.setattr(dev, "copy_on_side_stream", copy)
    monkeypatch.setattr(dev, "queue_copy", queue_copy)
    monkeypatch.setattr(dev, "staging", staging)
    monkeypatch.setattr(dev, "side_stream", lambda d: _Stream())
    monkeypatch.setattr(dev, "synchronize", lambda stream: log.append("sync"))
    monkeypatch.setattr(dev, "on_device", lambda d: contextlib.nullcontext())

    def mark(t: torch.Tensor) -> torch.Tensor:
        marked.add(t.untyped_storage().data_ptr())
        return t

    mark.log = log
    return mark


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("n", [1, 4096, 5000, (3 << 20) + 7])
def test_compat_mode_stages_cuda_tensors_through_pinned_memory(make, pretend_cuda, n, direct):
    # Note [kvikio compat mode serialises with compute]: kvikio is handed host memory only.
    b = make(chunk_bytes="1MiB", direct_io=None if direct else False)
    if b.gds:
        pytest.skip("this machine has GPUDirect Storage")
    src = pretend_cuda(_bytes(n, n))
    e = b.allocate(n)
    fences = []
    record = b.submit_write(e, src, checksum=True, ready=lambda: fences.append("producer")).result()
    assert record == zlib_crc(src)
    dst = pretend_cuda(torch.zeros(n, dtype=torch.uint8))
    b.submit_read(e, dst, checksum=record, ready=lambda: fences.append("consumer")).result()
    assert torch.equal(dst, src) and fences == ["producer", "consumer"]
    dst2 = pretend_cuda(torch.zeros(n, dtype=torch.uint8))
    arena = b._arenas[e.path_index]
    os.pwrite(arena.file.fileno(), bytes([src[n // 2].item() ^ 0xFF]), e.offset + n // 2)
    with pytest.raises(ChecksumError, match="checksum mismatch"):
        b.submit_read(e, dst2, checksum=record).result()


def test_compat_read_keeps_reading_while_copies_wait(make, pretend_cuda):
    # Each half of the staging buffer is reused only after its last copy was waited for.
    b = make(chunk_bytes="1MiB")
    n = (5 << 20) + 3
    src = pretend_cuda(_bytes(n, 9))
    e = b.allocate(n)
    b.submit_write(e, src).result()
    pretend_cuda.log.clear()
    dst = pretend_cuda(torch.zeros(n, dtype=torch.uint8))
    b.submit_read(e, dst, ready=lambda: None).result()
    assert torch.equal(dst, src)
    log = pretend_cuda.log
    assert log[0] == "order" and log[-1] == "sync" and log.count("order") == 1
    from ssdtrain.store._hostbuf import windows

    wins = list(windows(n, 0, 1 << 20, direct=b._arenas[0].direct))
    assert len(wins) >= 3 and log.count("wait copy") == len(wins) - 2  # from the third window on


class _StreamFile:
    """What cuFile's stream API does, done on the host (the arena's real file underneath)."""

    def __init__(self, file) -> None:
        self.file, self.calls = file, []

    def __getattr__(self, name):
        return getattr(self.file, name)

    def _host(self, buf, size):
        from ssdtrain.store._hostbuf import raw_view

        return raw_view(buf, 0, size) if isinstance(buf, torch.Tensor) else buf  # the pretend device tensor

    def pwrite(self, buf, size, file_offset, task_size):
        if isinstance(buf, torch.Tensor):
            self.calls.append(("pwrite", size, file_offset))
        return self.file.pwrite(self._host(buf, size), size, file_offset, task_size)

    def pread(self, buf, size, file_offset, task_size):
        if isinstance(buf, torch.Tensor):
            self.calls.append(("pread", size, file_offset))
        return self.file.pread(self._host(buf, size), size, file_offset, task_size)

    def raw_write_async(self, buf, stream, size, file_offset, dev_offset):
        from ssdtrain.store._hostbuf import raw_view

        self.calls.append(("write", size, file_offset, dev_offset))
        done = os.pwrite(self.file.fileno(), raw_view(buf, dev_offset, size), file_offset)
        return types.SimpleNamespace(check_bytes_done=lambda: done)

    def raw_read_async(self, buf, stream, size, file_offset, dev_offset):
        from ssdtrain.store._hostbuf import raw_view

        self.calls.append(("read", size, file_offset, dev_offset))
        done = os.preadv(self.file.fileno(), [raw_view(buf, dev_offset, size)], file_offset)
        return types.SimpleNamespace(check_bytes_done=lambda: done)


@pytest.mark.parametrize("stream_io", [True, False])
def test_gds_paths_move_the_tensor_whole(make, pretend_cuda, stream_io):
    # Note [GDS without a default-stream barrier]: with the stream API, one request per chunk on
    # the side stream, ordered after the fence on the device; else pread after a host wait.
    b = make(chunk_bytes="1MiB")
    arena = b._arenas[0]
    arena.gds = True
    b.stream_io = stream_io
    arena.file = _StreamFile(arena.file)
    n = (2 << 20) + 100
    src = pretend_cuda(_bytes(n, 11))
    e = b.allocate(n)
    record = b.submit_write(e, src, checksum=True, ready=lambda: None).result()
    dst = pretend_cuda(torch.zeros(n, dtype=torch.uint8))
    b.submit_read(e, dst, checksum=record, ready=lambda: None).result()
    assert torch.equal(dst, src)
    if stream_io:
        chunk = 1 << 20
        want = [(k, min(chunk, n - p), e.offset + p, p) for k in ("write", "read") for p in range(0, n, chunk)]
        assert arena.file.calls == want
        assert pretend_cuda.log.count("order") >= 2 and "sync" in pretend_cuda.log
    else:
        assert arena.file.calls == [("pwrite", n, e.offset), ("pread", n, e.offset)]
    assert "GDS, " + ("stream-ordered" if stream_io else "pread/pwrite") in b.describe()
    with pytest.raises(ChecksumError):
        dst[7] ^= 1
        b.submit_read(e, dst, checksum=record ^ 1).result()


def test_gds_open_failure_falls_back_to_compat_with_the_reason(cuda_driver, monkeypatch, tmp_path):
    from ssdtrain.store import kvikio_backend

    monkeypatch.setattr(kvikio_backend, "gds_status", lambda: (True, "GPUDirect Storage (nvidia_fs 2.26)"))
    monkeypatch.setattr(kvikio_backend, "GDS_FILESYSTEMS", frozenset({kvikio_backend._fs.fs_type(str(tmp_path))}))
    b = kvikio_backend.KvikioBackend(OffloadConfig(path=str(tmp_path), backend="kvikio"))
    try:
        if cuda_driver == "stand-in":  # no cuFile driver: registration with compat mode OFF fails
            assert not b.gds and "cuFile cannot register the arena file" in b.why
            src = _bytes(10_000, 12)
            e = b.allocate(src.numel())
            b.submit_write(e, src).result()
            dst = b.alloc_buffer(src.numel(), torch.device("cpu"), extent=e)
            b.submit_read(e, dst).result()
            assert torch.equal(dst, src)
    finally:
        b.close()


def zlib_crc(t: torch.Tensor) -> int:
    import zlib

    from ssdtrain.store._hostbuf import raw_view

    return zlib.crc32(raw_view(t, 0, t.numel()))
