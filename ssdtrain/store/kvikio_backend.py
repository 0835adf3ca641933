"""kvikio (cuFile): GPUDirect Storage for CUDA tensors where available, kvikio's POSIX path otherwise.

One arena file per path, opened as a ``kvikio.CuFile`` (which keeps a buffered and an O_DIRECT
descriptor). CUDA tensors go to ``CuFile.pwrite``/``pread`` as they are: with GDS the drive DMAs
straight to and from device memory; in compatibility mode kvikio moves them through its own
pinned bounce buffers. Host tensors take whole-page windows (Note [zero-copy direct I/O] in
``_hostbuf.py``) so that kvikio can use O_DIRECT without its bounce-buffer copy.

kvikio's settings are process-wide. The backend raises ``num_threads`` to at least
``io_threads x len(path)`` (never lowers it), passes ``chunk_bytes`` as each call's task size,
and sets ``auto_direct_io_read``/``auto_direct_io_write`` to follow ``direct_io`` (on unless
``direct_io=False``).

kvikio needs the CUDA driver library (``libcuda.so.1``) for any I/O, even on host memory; with a
driver but no usable GPU it serves host memory through POSIX I/O.
"""

from __future__ import annotations

import errno
import logging
import os
import zlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

try:
    import kvikio
    import kvikio.defaults
except ImportError:
    raise ImportError("kvikio is not installed; pip install 'ssdtrain[kvikio]'") from None

from ssdtrain.config import OffloadConfig
from ssdtrain.store._arena import Arena, ArenaBackend, private_name
from ssdtrain.store._hostbuf import lead_of, raw_view
from ssdtrain.store.base import ChecksumError, Extent, StorageError, align_up

__all__ = ["KvikioBackend"]

log = logging.getLogger(__name__)


def _settings(cfg: OffloadConfig) -> dict:
    want = {"auto_direct_io_read": cfg.direct_io is not False, "auto_direct_io_write": cfg.direct_io is not False}
    threads = cfg.io_threads * len(cfg.paths)
    if kvikio.defaults.get("num_threads") < threads:
        want["num_threads"] = threads
    return want


class _Arena(Arena):
    """An arena file opened by kvikio (cuFile)."""

    def __init__(self, index: int, path: str, cfg: OffloadConfig) -> None:
        from ssdtrain.store.posix import prepare_dir

        super().__init__(index, path)
        prepare_dir(path, create=cfg.create_path)
        with private_name(path) as name:  # Note [nothing left on disk] (in _arena.py)
            os.close(os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600))
            try:
                self.file = kvikio.CuFile(name, "r+")
            except RuntimeError as e:
                raise ValueError(f"kvikio cannot open a file in path={path!r}: {e}") from e
        self.direct = cfg.direct_io is not False and self.file.is_direct_io_supported()
        self.pool = ThreadPoolExecutor(cfg.io_threads, thread_name_prefix=f"ssdtrain-kvikio{index}")

    def error(self, what: str, nbytes: int, offset: int, e: BaseException) -> StorageError:
        text = str(e)
        code = errno.ENOSPC if "No space left" in text else getattr(e, "errno", None) or errno.EIO
        hint = ("free space on the drive, add another path, or set on_error='keep'" if code == errno.ENOSPC
                else "check the drive (dmesg, smartctl) and the GDS setup (gdscheck)")
        return StorageError(code, f"kvikio {what} of {nbytes} bytes at offset {offset} in the ssdtrain arena on "
                            f"{self.path!r} failed: {text}; {hint}")

    def fileno(self) -> int:
        return self.file.fileno()

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.file.close()


class KvikioBackend(ArenaBackend):
    """Files read and written by kvikio; CUDA tensors with GPUDirect Storage where it works."""

    name = "kvikio"

    def __init__(self, cfg: OffloadConfig) -> None:
        super().__init__(2 * cfg.prefetch_bytes)
        self.cfg = cfg
        self.task_size = cfg.chunk_bytes
        want = _settings(cfg)
        kvikio.defaults.set(want)
        self._open_arenas(cfg.paths, lambda i, p: _Arena(i, p, cfg))

    @property
    def gds(self) -> bool:
        """Whether CUDA tensors move by GPUDirect Storage (``False``: kvikio's compatibility mode)."""
        return not kvikio.defaults.is_compat_mode_preferred()

    def _window(self, arena: _Arena, extent: Extent, t: torch.Tensor, lead: int) -> tuple[object, int]:
        """The buffer kvikio moves and its size: whole pages for host memory (direct), the tensor."""
        if t.device.type != "cpu":
            return t, extent.nbytes
        if arena.direct:
            return raw_view(t, -lead, align_up(lead + extent.nbytes)), align_up(lead + extent.nbytes)
        return raw_view(t, 0, extent.nbytes), extent.nbytes

    def submit_write(self, extent: Extent, src: torch.Tensor, *, checksum: bool = False,
                     ready: Callable[[], None] | None = None) -> Future:
        arena = self._arenas[extent.path_index]
        lead = lead_of(src) if arena.direct else 0
        with arena.lock:
            arena.queued += extent.nbytes
            arena.leads[extent.offset] = lead
        fut = arena.pool.submit(self._write, arena, extent, src, lead, checksum, ready)
        fut.add_done_callback(lambda f: self._settle(arena, extent.nbytes, written=f.exception() is None))
        return fut

    def _write(self, arena: _Arena, extent: Extent, src: torch.Tensor, lead: int, checksum: bool,
               ready: Callable[[], None] | None) -> int | None:
        if ready is not None:
            ready()
        buf, size = self._window(arena, extent, src, lead)
        try:
            done = arena.file.pwrite(buf, size, extent.offset, self.task_size).get()
        except (RuntimeError, OSError) as e:
            raise arena.error("write", extent.nbytes, extent.offset, e) from e
        if done != size:
            raise arena.error("write", extent.nbytes, extent.offset, OSError(errno.EIO, f"short write: {done} of {size}"))
        return _crc(src, extent.nbytes) if checksum else None

    def submit_read(self, extent: Extent, dst: torch.Tensor, *, checksum: object = None,
                    ready: Callable[[], None] | None = None) -> Future:
        arena = self._arenas[extent.path_index]
        fut = arena.pool.submit(self._read, arena, extent, dst, self._lead(extent), checksum, ready)
        self._count_read(arena, fut, extent.nbytes)
        return fut

    def _read(self, arena: _Arena, extent: Extent, dst: torch.Tensor, lead: int, crc: object,
              ready: Callable[[], None] | None) -> None:
        if ready is not None:
            ready()
        n = extent.nbytes
        in_place = dst.device.type != "cpu" or not arena.direct or (
            lead_of(dst) == lead and _room_before(dst) >= lead and _room_after(dst) >= align_up(lead + n) - lead)
        if in_place:
            buf, size = self._window(arena, extent, dst, lead)
            offset = extent.offset
        else:
            # A buffer not from alloc_buffer: read the payload only (kvikio splits off what is
            # not page-aligned and moves it through its own bounce buffer).
            buf, size, offset = raw_view(dst, 0, n), n, extent.offset + lead
        try:
            done = arena.file.pread(buf, size, offset, self.task_size).get()
        except (RuntimeError, OSError) as e:
            raise arena.error("read", n, extent.offset, e) from e
        if done != size:
            raise arena.error("read", n, extent.offset, OSError(errno.EIO, f"short read: {done} of {size} bytes"))
        if crc is not None and _crc(dst, n) != crc:
            raise ChecksumError(errno.EIO, f"checksum mismatch reading {n} bytes at offset {extent.offset} of the "
                                f"arena on {arena.path!r}: the drive returned different bytes than were written")

    # -- bookkeeping --------------------------------------------------------------------------------
    def describe(self) -> str:
        mode = "GDS" if self.gds else "compat"
        return f"kvikio ({mode}): " + ", ".join(
            f"{a.path} ({'O_DIRECT' if a.direct else 'buffered'})" for a in self._arenas)


def _room_before(t: torch.Tensor) -> int:
    return t.storage_offset() * t.element_size()


def _room_after(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes() - _room_before(t)


def _crc(t: torch.Tensor, n: int) -> int:
    """CRC32 of the first ``n`` bytes of ``t`` (a device tensor is copied to the host in pieces)."""
    if t.device.type == "cpu":
        return zlib.crc32(raw_view(t, 0, n))
    crc = 0
    step = 64 << 20
    for start in range(0, n, step):
        part = t[start:min(start + step, n)].cpu()
        crc = zlib.crc32(raw_view(part, 0, part.numel()), crc)
    return crc
