"""POSIX files: ``pwrite``/``preadv`` on a thread pool per path, O_DIRECT where the filesystem allows.

One arena file per path. It is created ``O_EXCL`` with mode 0600 inside a fresh private
directory (0700), and both are unlinked right after opening (Note [nothing left on disk]).
Extents are 4 KiB aligned; tensors larger than ``chunk_bytes`` are split into requests that
run in parallel. With O_DIRECT, chunks whose memory is page-aligned go straight from the
tensor to the drive; others pass through a page-aligned staging buffer of the I/O thread.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import secrets
import threading
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import Callable

import torch

from ssdtrain import device
from ssdtrain.config import OffloadConfig
from ssdtrain.store import _fs
from ssdtrain.store._mem import capacity, gather, host_view, profiled
from ssdtrain.store.allocator import ExtentAllocator
from ssdtrain.store.base import ALIGN, Backend, ChecksumError, Extent, StorageError, align_up

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


# Note [nothing left on disk]
# The arena is reachable only through our file descriptors: the directory and the file are
# removed right after opening. A process killed with SIGKILL leaves nothing to clean up (the
# kernel frees the blocks when the last descriptor closes), two offloaders or processes can never
# open each other's arena, and the private directory (0700, O_EXCL file 0600) is never followed
# through a symlink: mkdir refuses any existing name.
class _Arena:
    def __init__(self, index: int, path: str, cfg: OffloadConfig) -> None:
        self.index = index
        self.path = path
        self.lock = threading.Lock()
        self.alloc = ExtentAllocator(ALIGN)
        self.queued = 0
        self.written = 0
        self.read = 0
        private = os.path.join(path, f"ssdtrain-{os.getpid()}-{secrets.token_hex(6)}")
        try:
            os.mkdir(private, 0o700)
        except FileExistsError as e:
            raise ValueError(f"{private!r} already exists; refusing to use or follow it") from e
        except OSError as e:
            raise ValueError(f"cannot create a directory in path={path!r} ({e.strerror})") from e
        name = os.path.join(private, "arena")
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        try:
            self.fd = os.open(name, flags, 0o600)
            self.fd_direct = self._open_direct(name, cfg.direct_io)
        finally:
            for undo in (lambda: os.unlink(name), lambda: os.rmdir(private)):
                try:
                    undo()
                except FileNotFoundError:
                    pass
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


def _staging(nbytes: int) -> tuple[mmap.mmap, torch.Tensor]:
    """This thread's page-aligned staging buffer, at least ``nbytes`` long."""
    buf = getattr(_local, "buf", None)
    if buf is None or len(buf[0]) < nbytes:
        mm = mmap.mmap(-1, align_up(nbytes))
        buf = _local.buf = (mm, torch.frombuffer(mm, dtype=torch.uint8))
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


class PosixBackend(Backend):
    """Files on local filesystems, through the kernel; the default on the CPU."""

    name = "posix"

    def __init__(self, cfg: OffloadConfig) -> None:
        self.cfg = cfg
        self.chunk = cfg.chunk_bytes
        self._arenas: list[_Arena] = []
        self._place_lock = threading.Lock()
        self._closed = False
        try:
            for i, p in enumerate(cfg.paths):
                prepare_dir(p, create=cfg.create_path)
                self._arenas.append(_Arena(i, p, cfg))
        except BaseException:
            self.close()
            raise
        for a in self._arenas:
            if _fs.is_ram_backed(a.path):
                log.warning("ssdtrain: %s is RAM-backed (%s): offloading there saves no memory",
                            a.path, _fs.fs_type(a.path))

    # -- extents ---------------------------------------------------------------------------
    def allocate(self, nbytes: int) -> Extent:
        with self._place_lock:
            # Stripe by load: the path with the fewest bytes waiting gets the next extent.
            arena = min(self._arenas, key=lambda a: (a.queued, a.alloc.used_bytes))
            with arena.lock:
                offset, length = arena.alloc.allocate(max(nbytes, 1))
        return Extent(arena.index, offset, nbytes, length)

    def free(self, extent: Extent) -> None:
        arena = self._arenas[extent.path_index]
        with arena.lock:
            if not self._closed:
                # Punch before the range can be handed out again: a later punch could hit new data.
                _fs.punch_hole(arena.fd, extent.offset, extent.length)
            arena.alloc.free(extent.offset, extent.length)

    # -- I/O ---------------------------------------------------------------------------------
    def _chunks(self, extent: Extent):
        for start in range(0, extent.nbytes, self.chunk):
            yield start, min(self.chunk, extent.nbytes - start)

    def submit_write(self, extent: Extent, src: torch.Tensor, *, checksum: bool = False,
                     ready: Callable[[], None] | None = None) -> Future:
        arena = self._arenas[extent.path_index]
        with arena.lock:
            arena.queued += extent.nbytes
        ready_once = _Once(ready) if ready is not None else None
        futures = [arena.pool.submit(self._write_chunk, arena, src, start, n, extent.offset + start, checksum,
                                     ready_once)
                   for start, n in self._chunks(extent)]
        out = gather(futures)
        out.add_done_callback(lambda f: self._settle(arena, extent.nbytes, written=f.exception() is None))
        return out

    def _settle(self, arena: _Arena, nbytes: int, *, written: bool) -> None:
        with arena.lock:
            arena.queued -= nbytes
            if written:
                arena.written += nbytes

    def _write_chunk(self, arena: _Arena, src: torch.Tensor, start: int, n: int, offset: int,
                     checksum: bool, ready) -> int | None:
        with profiled("ssdtrain.write"):
            return self._write_chunk_now(arena, src, start, n, offset, checksum, ready)

    def _write_chunk_now(self, arena: _Arena, src: torch.Tensor, start: int, n: int, offset: int,
                         checksum: bool, ready) -> int | None:
        if ready is not None:
            ready()
        crc = None
        try:
            if device.is_cuda(src):
                mm, staged = _staging(n)
                device.copy_on_side_stream(staged[:n], src[start:start + n])
                mv = memoryview(mm)
                fd, length = (arena.fd_direct, align_up(n)) if arena.direct else (arena.fd, n)
            elif arena.direct and (src.data_ptr() + start) % ALIGN == 0 and n % ALIGN == 0:
                mv, fd, length = host_view(src, start, n), arena.fd_direct, n
            elif arena.direct:
                mm, staged = _staging(n)
                # Note [no torch ops on I/O threads]: a torch copy here would start an OpenMP team
                # per I/O thread, spinning against the compute threads on the same cores.
                ctypes.memmove(staged.data_ptr(), src.data_ptr() + start, n)
                mv, fd, length = memoryview(mm), arena.fd_direct, align_up(n)
            else:
                mv, fd, length = host_view(src, start, n), arena.fd, n
            if checksum:
                crc = zlib.crc32(mv[:n])
            _full_write(fd, mv[:length], offset)
        except OSError as e:
            raise arena.error("write", n, offset, e) from e
        return crc

    def alloc_buffer(self, nbytes: int, device_: torch.device) -> torch.Tensor:
        if device_.type != "cpu" or not any(a.direct for a in self._arenas):
            return super().alloc_buffer(nbytes, device_)
        # Room for the aligned tail that O_DIRECT reads, starting on a page boundary.
        raw = torch.empty(align_up(nbytes) + ALIGN, dtype=torch.uint8)
        skip = (-raw.data_ptr()) % ALIGN
        return raw[skip:skip + nbytes]

    def submit_read(self, extent: Extent, dst: torch.Tensor, *, checksum: object = None,
                    ready: Callable[[], None] | None = None) -> Future:
        arena = self._arenas[extent.path_index]
        ready_once = _Once(ready) if ready is not None else None
        crcs = checksum if checksum is not None else None
        futures = [arena.read_pool.submit(self._read_chunk, arena, dst, start, n, extent.offset + start,
                                     None if crcs is None else crcs[i], ready_once)
                   for i, (start, n) in enumerate(self._chunks(extent))]
        out = gather(futures)

        def count(f: Future) -> None:
            if f.exception() is None:
                with arena.lock:
                    arena.read += extent.nbytes
        out.add_done_callback(count)
        return out

    def _read_chunk(self, arena: _Arena, dst: torch.Tensor, start: int, n: int, offset: int,
                    crc: int | None, ready) -> None:
        with profiled("ssdtrain.read"):
            self._read_chunk_now(arena, dst, start, n, offset, crc, ready)

    def _read_chunk_now(self, arena: _Arena, dst: torch.Tensor, start: int, n: int, offset: int,
                        crc: int | None, ready) -> None:
        if ready is not None:
            ready()
        try:
            length = align_up(n) if arena.direct else n
            if (not device.is_cuda(dst) and (not arena.direct or (
                    (dst.data_ptr() + start) % ALIGN == 0 and capacity(dst) - start >= length))):
                mv = host_view(dst, start, length)
                _full_read(arena.fd_direct if arena.direct else arena.fd, mv, offset)
                payload = mv[:n]
            else:
                mm, staged = _staging(n)
                mv = memoryview(mm)[:length]
                _full_read(arena.fd_direct if arena.direct else arena.fd, mv, offset)
                payload = mv[:n]
                if device.is_cuda(dst):
                    device.copy_on_side_stream(dst[start:start + n], staged[:n])
                else:
                    ctypes.memmove(dst.data_ptr() + start, staged.data_ptr(), n)
        except OSError as e:
            raise arena.error("read", n, offset, e) from e
        if crc is not None and zlib.crc32(payload) != crc:
            raise ChecksumError(errno.EIO, f"checksum mismatch reading {n} bytes at offset {offset} of the arena "
                                f"on {arena.path!r}: the drive returned different bytes than were written")

    # -- bookkeeping -------------------------------------------------------------------------
    def written_bytes_by_path(self) -> dict[str, int]:
        return {a.path: a.written for a in self._arenas}

    def read_bytes_by_path(self) -> dict[str, int]:
        return {a.path: a.read for a in self._arenas}

    def describe(self) -> str:
        return "posix: " + ", ".join(f"{a.path} ({'O_DIRECT' if a.direct else 'buffered'})" for a in self._arenas)

    @property
    def direct(self) -> bool:
        return all(a.direct for a in self._arenas)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for a in self._arenas:
            a.close()


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
