"""POSIX files: ``pwrite``/``preadv`` on a thread pool per path, O_DIRECT where the filesystem allows.

One arena file per path, mode 0600, that never has a name (``O_TMPFILE``; elsewhere created
``O_EXCL`` in a fresh private directory, 0700, and both unlinked right after opening: Note
[nothing left on disk]).
Extents are 4 KiB aligned; tensors larger than ``chunk_bytes`` are split into requests, moved in
order by one I/O thread when they go direct from host memory and in parallel when they copy
(Note [one task per direct request]). With O_DIRECT, host tensors go straight between their own
memory pages and the drive (Note [zero-copy direct I/O] in ``_hostbuf.py``), reads land in
reusable buffers (Note [reuse reload memory]), and CUDA tensors pass through a page-aligned,
pinned staging buffer of the I/O thread (Note [pinned staging for CUDA tensors]). Freed space is
punched only once it has stayed free for a while (Note [trim what stays free] in
``allocator.py``).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import threading
import zlib
from concurrent.futures import Future
from collections.abc import Callable

import torch

from ssdtrain.device import cuda as device
from ssdtrain.config import OffloadConfig
from ssdtrain.store import _fs
from ssdtrain.store._arena import Arena, ArenaBackend, open_unnamed
from ssdtrain.store._hostbuf import HostMapping, lead_of, raw_view, windows
from ssdtrain.store._mem import capacity, gather, profiled
from ssdtrain.store._pool import IOPool
from ssdtrain.store.base import ALIGN, ChecksumError, Extent, StorageError, align_up

log = logging.getLogger(__name__)

# Seams for fault-injection tests (a full drive, EIO, short transfers): tests replace these.
_pwrite = os.pwrite
_preadv = os.preadv


_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})


def prepare_dir(path: str, *, create: bool) -> list[str]:
    """Checks (and maybe creates, 0700 at every level) an offload directory; raises
    ``ValueError`` saying what to do, having removed whatever it created.

    Returns:
        The directories it created, parents first (to remove if opening the arena fails).
    """
    if os.path.lexists(path) and not os.path.isdir(path):
        raise ValueError(f"path={path!r} is not a directory (it is a file); give a directory on the drive to use")
    created: list[str] = []
    if not os.path.exists(path):
        if not create:
            raise ValueError(f"path={path!r} does not exist; create it or pass create_path=True")
        try:
            created = _fs.make_dirs(path)
        except OSError as e:
            raise ValueError(f"path={path!r} does not exist and cannot be created ({e.strerror}); "
                             "create it yourself or choose another directory") from e
    if not os.access(path, os.W_OK | os.X_OK):
        _fs.remove_dirs(created)
        raise ValueError(f"path={path!r} is not writable by this process; choose a directory you can write to")
    return created


def _drive_full(path: str, e: OSError) -> StorageError:
    try:
        free = f"{_fs.free_bytes(path)} bytes free"
    except OSError:
        free = "free space unknown"
    return StorageError(e.errno or errno.ENOSPC, f"the drive holding path={path!r} is full ({e.strerror}; {free}): "
                        "free space on it or choose another path")


class _Arena(Arena):
    """An arena file opened twice: buffered, and with O_DIRECT where the filesystem allows."""

    def __init__(self, index: int, path: str, cfg: OffloadConfig) -> None:
        super().__init__(index, path)
        self.fd: int | None = None
        self.fd_direct: int | None = None
        self.created = prepare_dir(path, create=cfg.create_path)
        try:
            try:
                self.fd = open_unnamed(path)  # Note [nothing left on disk]
            except OSError as e:
                if e.errno in _FULL:
                    raise _drive_full(path, e) from e
                raise ValueError(f"cannot create a file in path={path!r} ({e.strerror}); "
                                 "choose a directory you can write to") from e
            self.fd_direct = self._open_direct(cfg.direct_io)
        except BaseException:
            self.forget()
            _fs.remove_dirs(self.created)
            raise
        self.direct = self.fd_direct is not None
        # Reads have their own threads: backward waits on them, so they never queue behind writes.
        self.pool = IOPool(cfg.io_threads, f"ssdtrain-io{index}")
        self.read_pool = IOPool(cfg.io_threads, f"ssdtrain-io{index}r")

    def _open_direct(self, want: bool | None) -> int | None:
        """A second descriptor of the arena with O_DIRECT, opened through ``/proc/self/fd`` (the
        file has no name), once a test write shows that the filesystem takes direct I/O."""
        if want is False or not hasattr(os, "O_DIRECT"):
            return None
        reason = ""
        try:
            fd = os.open(f"/proc/self/fd/{self.fd}", os.O_RDWR | os.O_DIRECT | getattr(os, "O_CLOEXEC", 0))
        except OSError as e:
            fd, reason = None, e.strerror
        if fd is not None:
            probe = mmap.mmap(-1, ALIGN)
            try:
                os.pwrite(fd, probe, 0)
            except OSError as e:
                os.close(fd)
                if e.errno in _FULL:  # a full drive, not a filesystem without O_DIRECT
                    raise _drive_full(self.path, e) from e
                fd, reason = None, e.strerror
            finally:
                probe.close()
        if fd is None and want:
            raise ValueError(f"direct_io=True but {self.path!r} ({_fs.fs_type(self.path)}) does not support "
                             f"O_DIRECT ({reason}); set direct_io=None to fall back to buffered I/O")
        return fd

    def fileno(self) -> int:
        return self.fd

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.read_pool.shutdown(wait=True)
        self.forget()

    def forget(self) -> None:
        fds, self.fd, self.fd_direct = (self.fd, self.fd_direct), None, None
        for fd in fds:
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


# Note [pinned staging for CUDA tensors]
# GPU-ONLY CODE (not run in this project's CI, which has no GPU). A CUDA tensor goes between the
# device and the drive through a staging buffer of the I/O thread. From pageable memory every
# host/device copy is synchronous and moves at about half the speed of pinned memory, so CUDA
# tensors are staged in pinned (page-locked) memory. O_DIRECT needs it page-aligned as well:
# torch's pinned allocator does not promise that, so the buffer has a page of slack and starts
# at the first page boundary in it. Host tensors never use it (they stage in ``HostMapping``s).
def _staging(nbytes: int, *, pinned: bool = False) -> tuple[memoryview, torch.Tensor]:
    """This thread's page-aligned staging buffer, at least ``nbytes`` long: pinned for CUDA
    tensors (Note [pinned staging for CUDA tensors]), else on huge pages when it is large enough
    (Note [huge pages make large requests] in ``_hostbuf.py``)."""
    attr = "pinned" if pinned else "buf"
    buf = getattr(_local, attr, None)
    if buf is None or len(buf[0]) < nbytes:
        size = align_up(nbytes)
        if pinned:
            block = device.pinned_empty(size + ALIGN)
            staged = block[-block.data_ptr() % ALIGN:][:size]
            buf = (raw_view(staged, 0, size), staged)  # ``staged`` keeps the memory alive
        else:
            m = HostMapping(size)
            mv = memoryview(m.mm)[m.start:m.start + size]
            buf = (mv, torch.frombuffer(mv, dtype=torch.uint8))
        setattr(_local, attr, buf)
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
        self._check_process()
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
                mm, staged = _staging(wn, pinned=True)
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
        self._check_process()
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
                mm, staged = _staging(wn, pinned=device.is_cuda(dst))
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
