"""POSIX files: ``pwrite``/``preadv`` on a thread pool per path, O_DIRECT where the filesystem allows.

One arena file per path. It is created ``O_EXCL`` with mode 0600 inside a fresh private
directory (0700), and both are unlinked right after opening (Note [nothing left on disk]).
Extents are 4 KiB aligned; tensors larger than ``chunk_bytes`` are split into requests, moved in
order by one I/O thread when they go direct from host memory and in parallel when they copy
(Note [one task per direct request]). With O_DIRECT, host tensors go straight between their own
memory pages and the drive (Note [zero-copy direct I/O] in ``_hostbuf.py``), reads land in
reusable buffers (Note [reuse reload memory]), and CUDA tensors pass through a page-aligned
staging buffer of the I/O thread. Freed space is punched only once it has stayed free for a while
(Note [trim what stays free] in ``allocator.py``).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import threading
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import Callable

import torch

from ssdtrain import device
from ssdtrain.config import OffloadConfig
from ssdtrain.store import _fs
from ssdtrain.store._arena import Arena, ArenaBackend, private_name
from ssdtrain.store._hostbuf import HostMapping, lead_of, raw_view, windows
from ssdtrain.store._mem import capacity, gather, profiled
from ssdtrain.store.base import ALIGN, ChecksumError, Extent, StorageError, align_up

log = logging.getLogger(__name__)

# Seams for fault-injection tests (a full drive, EIO, short transfers): tests replace these.
_pwrite = os.pwrite
_preadv = os.preadv


def prepare_dir(path: str, *, create: bool) -> None:
    """Checks (and maybe creates) an offload directory; raises ``ValueError`` saying what to do."""
    if os.path.lexists(path) and not os.path.isdir(path):
        raise ValueError(f"path={path!r} is not a directory (it is a file); give a directory on the drive to use")
    if not os.path.exists(path):
        if not create:
            raise ValueError(f"path={path!r} does not exist; create it or pass create_path=True")
        try:
            os.makedirs(path, mode=0o700, exist_ok=True)
        except OSError as e:
            raise ValueError(f"path={path!r} does not exist and cannot be created ({e.strerror}); "
                             "create it yourself or choose another directory") from e
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"path={path!r} is not writable by this process; choose a directory you can write to")


class _Arena(Arena):
    """An arena file opened twice: buffered, and with O_DIRECT where the filesystem allows."""

    def __init__(self, index: int, path: str, cfg: OffloadConfig) -> None:
        super().__init__(index, path)
        prepare_dir(path, create=cfg.create_path)
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        with private_name(path) as name:  # Note [nothing left on disk]
            self.fd = os.open(name, flags, 0o600)
            self.fd_direct = self._open_direct(name, cfg.direct_io)
        self.direct = self.fd_direct is not None
        # Reads have their own threads: backward waits on them, so they never queue behind writes.
        self.pool = ThreadPoolExecutor(cfg.io_threads, thread_name_prefix=f"ssdtrain-io{index}")
        self.read_pool = ThreadPoolExecutor(cfg.io_threads, thread_name_prefix=f"ssdtrain-io{index}r")

    def _open_direct(self, name: str, want: bool | None) -> int | None:
        if want is False or not hasattr(os, "O_DIRECT"):
            return None
        reason = ""
        try:
            fd = os.open(name, os.O_RDWR | os.O_DIRECT | getattr(os, "O_CLOEXEC", 0))
        except OSError as e:
            fd, reason = None, e.strerror
        if fd is not None:
            probe = mmap.mmap(-1, ALIGN)
            try:
                os.pwrite(fd, probe, 0)
            except OSError as e:
                os.close(fd)
                fd, reason = None, e.strerror
            finally:
                probe.close()
        if fd is None and want:
            os.close(self.fd)
            raise ValueError(f"direct_io=True but {self.path!r} ({_fs.fs_type(self.path)}) does not support "
                             f"O_DIRECT ({reason}); set direct_io=None to fall back to buffered I/O")
        return fd

    def fileno(self) -> int:
        return self.fd

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.read_pool.shutdown(wait=True)
        for fd in (self.fd, self.fd_direct):
            if fd is not None:
                os.close(fd)

    def error(self, what: str, nbytes: int, offset: int, e: OSError) -> StorageError:
        try:
            st = os.statvfs(self.path)
            free = f"{st.f_bavail * st.f_frsize} bytes free"
        except OSError:
            free = "free space unknown"
        hint = {errno.ENOSPC: "free space on the drive, add another path, or set on_error='keep'",
                errno.EIO: "the drive reported an I/O error; check its health (dmesg, smartctl)"}.get(
                    e.errno or 0, "check the drive")
        return StorageError(e.errno or errno.EIO, f"{what} of {nbytes} bytes at offset {offset} in the ssdtrain "
                            f"arena on {self.path!r} failed: {e.strerror or e} ({free}); {hint}")


_local = threading.local()


def _staging(nbytes: int) -> tuple[memoryview, torch.Tensor]:
    """This thread's page-aligned staging buffer, at least ``nbytes`` long, on huge pages when
    it is large enough (Note [huge pages make large requests] in ``_hostbuf.py``)."""
    buf = getattr(_local, "buf", None)
    if buf is None or len(buf[0]) < nbytes:
        size = align_up(nbytes)
        m = HostMapping(size)
        mv = memoryview(m.mm)[m.start:m.start + size]
        buf = _local.buf = (mv, torch.frombuffer(mv, dtype=torch.uint8))
    return buf


def _full_write(fd: int, mv: memoryview, offset: int) -> None:
    done = 0
    while done < len(mv):
        n = _pwrite(fd, mv[done:], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, "short write: the drive accepted no bytes")
        done += n


def _full_read(fd: int, mv: memoryview, offset: int) -> None:
    done = 0
    while done < len(mv):
        n = _preadv(fd, [mv[done:]], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, f"short read: {done} of {len(mv)} bytes, then end of file")
        done += n


class PosixBackend(ArenaBackend):
    """Files on local filesystems, through the kernel; the default on the CPU."""

    name = "posix"

    def __init__(self, cfg: OffloadConfig) -> None:
        super().__init__(2 * cfg.prefetch_bytes)
        self.cfg = cfg
        self.chunk = cfg.chunk_bytes
        self._open_arenas(cfg.paths, lambda i, p: _Arena(i, p, cfg))

    # -- I/O ---------------------------------------------------------------------------------
    def _windows(self, arena: _Arena, extent: Extent, lead: int):
        return windows(extent.nbytes, lead, self.chunk, direct=arena.direct)

    def _groups(self, arena: _Arena, extent: Extent, lead: int, on_gpu: bool) -> list[list[tuple[int, int, int, int]]]:
        """The request's windows, grouped into thread-pool tasks.

        Note [one task per direct request]: with O_DIRECT each window's syscall already reaches
        the drive as all of its device requests at once (the kernel submits them together and
        waits for the lot), so splitting a host tensor's request across threads buys no
        parallelism the drive can use; it costs a task, a future and a wake-up per window, on
        the thread that computes too. A direct request on host memory is therefore one task
        that moves its windows in order; buffered I/O (copies through the page cache) and GPU
        tensors (a staging copy per window) keep a task per window, which does overlap.
        """
        wins = list(self._windows(arena, extent, lead))
        if arena.direct and not on_gpu:
            return [wins]
        return [[w] for w in wins]

    def submit_write(self, extent: Extent, src: torch.Tensor, *, checksum: bool = False,
                     ready: Callable[[], None] | None = None) -> Future:
        arena = self._arenas[extent.path_index]
        lead = lead_of(src) if arena.direct else 0
        with arena.lock:
            arena.queued += extent.nbytes
            arena.leads[extent.offset] = lead
        ready_once = _Once(ready) if ready is not None else None
        futures = [arena.pool.submit(self._write_chunks, arena, src, extent.offset, lead, g, checksum, ready_once)
                   for g in self._groups(arena, extent, lead, device.is_cuda(src))]
        out = gather(futures, flatten=True)
        out.add_done_callback(lambda f: self._settle(arena, extent.nbytes, written=f.exception() is None))
        return out

    def _write_chunks(self, arena: _Arena, src: torch.Tensor, base: int, lead: int, group, checksum: bool,
                      ready) -> list[int | None]:
        with profiled("ssdtrain.write"):
            return [self._write_chunk_now(arena, src, base, lead, w, checksum, ready) for w in group]

    def _write_chunk_now(self, arena: _Arena, src: torch.Tensor, base: int, lead: int, window, checksum: bool,
                         ready) -> int | None:
        w0, wn, p0, p1 = window
        if ready is not None:
            ready()
        crc = None
        try:
            if device.is_cuda(src):
                mm, staged = _staging(wn)
                device.copy_on_side_stream(staged[:p1 - p0], src[p0:p1])
                mv, payload = memoryview(mm)[:wn], memoryview(mm)[:p1 - p0]
            else:
                # Whole pages of the tensor's own memory: no copy (Note [zero-copy direct I/O]).
                mv, payload = raw_view(src, w0 - lead, wn), raw_view(src, p0, p1 - p0)
            if checksum:
                crc = zlib.crc32(payload)
            _full_write(arena.fd_direct if arena.direct else arena.fd, mv, base + w0)
        except OSError as e:
            raise arena.error("write", p1 - p0, base + w0, e) from e
        return crc

    def submit_read(self, extent: Extent, dst: torch.Tensor, *, checksum: object = None,
                    ready: Callable[[], None] | None = None) -> Future:
        arena = self._arenas[extent.path_index]
        lead = self._lead(extent)
        # In place only into whole pages the buffer owns (one from alloc_buffer(extent=...));
        # anything else goes through staging.
        in_place = not device.is_cuda(dst) and (not arena.direct or (
            lead_of(dst) == lead and dst.storage_offset() * dst.element_size() >= lead
            and capacity(dst) >= align_up(lead + extent.nbytes) - lead))
        ready_once = _Once(ready) if ready is not None else None
        crcs = checksum  # one per window, in order
        futures, first = [], 0
        for g in self._groups(arena, extent, lead, device.is_cuda(dst)):
            crc = None if crcs is None else crcs[first:first + len(g)]
            futures.append(arena.read_pool.submit(self._read_chunks, arena, dst, extent.offset, lead, g, in_place,
                                                  crc, ready_once))
            first += len(g)
        out = gather(futures)
        self._count_read(arena, out, extent.nbytes)
        return out

    def _read_chunks(self, arena: _Arena, dst: torch.Tensor, base: int, lead: int, group, in_place: bool,
                     crcs: list | None, ready) -> None:
        with profiled("ssdtrain.read"):
            for i, w in enumerate(group):
                self._read_chunk_now(arena, dst, base, lead, w, in_place, None if crcs is None else crcs[i], ready)

    def _read_chunk_now(self, arena: _Arena, dst: torch.Tensor, base: int, lead: int, window, in_place: bool,
                        crc: int | None, ready) -> None:
        w0, wn, p0, p1 = window
        if ready is not None:
            ready()
        fd = arena.fd_direct if arena.direct else arena.fd
        try:
            if in_place:
                _full_read(fd, raw_view(dst, w0 - lead, wn), base + w0)
                payload = raw_view(dst, p0, p1 - p0)
            else:
                mm, staged = _staging(wn)
                _full_read(fd, memoryview(mm)[:wn], base + w0)
                s0 = p0 + lead - w0
                payload = memoryview(mm)[s0:s0 + p1 - p0]
                if device.is_cuda(dst):
                    device.copy_on_side_stream(dst[p0:p1], staged[s0:s0 + p1 - p0])
                else:
                    # Note [no torch ops on I/O threads]
                    ctypes.memmove(dst.data_ptr() + p0, staged.data_ptr() + s0, p1 - p0)
        except OSError as e:
            raise arena.error("read", p1 - p0, base + w0, e) from e
        if crc is not None and zlib.crc32(payload) != crc:
            raise ChecksumError(errno.EIO, f"checksum mismatch reading {p1 - p0} bytes at offset {base + w0} of the "
                                f"arena on {arena.path!r}: the drive returned different bytes than were written")

    # -- bookkeeping -------------------------------------------------------------------------
    def describe(self) -> str:
        return "posix: " + ", ".join(f"{a.path} ({'O_DIRECT' if a.direct else 'buffered'})" for a in self._arenas)

    @property
    def direct(self) -> bool:
        return all(a.direct for a in self._arenas)


class _Once:
    """Calls a fence at most once, whichever chunk of a request reaches it first."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self._fn: Callable[[], None] | None = fn
        self._lock = threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            if self._fn is not None:
                self._fn()
                self._fn = None
