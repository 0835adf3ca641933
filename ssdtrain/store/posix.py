"""POSIX files: ``pwrite``/``preadv`` on a thread pool per path, O_DIRECT where the filesystem allows.

One arena file per path. It is created ``O_EXCL`` with mode 0600 inside a fresh private
directory (0700), and both are unlinked right after opening (Note [nothing left on disk]).
Extents are 4 KiB aligned; tensors larger than ``chunk_bytes`` are split into requests, moved in
order by one I/O thread when they go direct from host memory and in parallel when they copy
(Note [one task per direct request]). With O_DIRECT, host tensors go straight between their own
memory pages and the drive (Note [zero-copy direct I/O] in ``_hostbuf.py``), reads land in
reusable buffers (Note [reuse reload memory]), and CUDA tensors pass through a page-aligned
staging buffer of the I/O thread. Freed space is punched only once it has stayed free for a while
(Note [trim what stays free] in ``allocator.py``). With ``io_engine="uring"``, O_DIRECT host
requests skip the threads: they go through io_uring from the calling thread and complete when
the engine polls (Note [I/O without threads] in ``_uring.py``, Note [a shallow ring] below).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import threading
import time
import zlib
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import Callable

import torch

from ssdtrain import device
from ssdtrain.config import OffloadConfig
from ssdtrain.store import _fs, _uring
from ssdtrain.store._arena import Arena, ArenaBackend, private_name
from ssdtrain.store._hostbuf import HostMapping, lead_of, raw_view, windows
from ssdtrain.store._mem import capacity, gather, profiled
from ssdtrain.store.base import ALIGN, ChecksumError, Extent, StorageError, align_up

log = logging.getLogger(__name__)

# Seams for fault-injection tests (a full drive, EIO, short transfers): tests replace these.
_pwrite = os.pwrite
_preadv = os.preadv


def _ring_result(op: int, res: int, length: int) -> int:
    """What a ring completion reports (a byte count or ``-errno``); a seam like the two above."""
    return res


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
        self._ring = None
        self._backlog_lock = threading.Lock()
        self._backlog = {_uring.OP_READ: deque(), _uring.OP_WRITE: deque()}
        self._in_ring = {_uring.OP_READ: 0, _uring.OP_WRITE: 0}
        self._ring_depth = 2 * cfg.io_threads * len(cfg.paths)  # windows per direction
        try:
            self._ring = self._open_ring(cfg.io_engine)
        except BaseException:
            self.close()
            raise

    def _open_ring(self, engine: str) -> _uring.Ring | None:
        """Note [I/O without threads] in ``_uring.py``: O_DIRECT host I/O through io_uring."""
        if engine == "threads":
            return None
        direct = any(a.direct for a in self._arenas)
        reason = None if direct else "the offload path is not opened with O_DIRECT (direct_io=False, or " \
                                     "its filesystem refuses it)"
        reason = reason or _uring.unavailable_reason()
        ring = None
        if reason is None:
            try:
                ring = _uring.Ring(256, self._ring_done)
            except OSError as e:
                reason = f"io_uring_setup failed: {e.strerror or e}"
        if reason is not None:
            if engine == "uring":
                raise ValueError(f"io_engine='uring' cannot be used: {reason}; set io_engine='auto' or 'threads'")
            log.info("ssdtrain: posix backend uses I/O threads (%s)", reason)
        return ring

    def close(self) -> None:
        ring, self._ring = getattr(self, "_ring", None), None
        if ring is not None:
            ring.close()  # waits for what is in flight, completing its futures
        super().close()

    # -- the ring (Note [I/O without threads]) ---------------------------------------------------
    def _on_ring(self, arena: _Arena, t: torch.Tensor, checksum) -> bool:
        """Direct host I/O without checksums goes on the ring; ``checksum`` is a write's flag, or
        a read's record (a list with ``None`` per window when nothing was checksummed)."""
        if isinstance(checksum, list):
            checksum = any(c is not None for c in checksum)
        return self._ring is not None and arena.direct and not device.is_cuda(t) and not checksum

    def _ring_submit(self, what: str, arena: _Arena, t: torch.Tensor, base: int, lead: int, nbytes: int,
                     ready) -> Future:
        wins = list(self._windows(arena, Extent(arena.index, base, nbytes, 0), lead))
        fut = _RingFuture(self._ring)
        req = _RingRequest(fut, arena, t, what, len(wins))
        if ready is not None:
            ready()
        op = _uring.OP_WRITE if what == "write" else _uring.OP_READ
        addr = t.data_ptr() - lead
        with self._backlog_lock:
            self._backlog[op].extend(_RingWindow(req, op, addr + w0, wn, base + w0, p1 - p0)
                                     for w0, wn, p0, p1 in wins)
        self._ring_pump(op)
        return fut

    def _ring_pump(self, op: int) -> None:
        """Note [a shallow ring]: windows go to the kernel in order, at most ``_ring_depth`` of a
        direction at a time. Reads all issued at once share the drive, so the one backward needs
        next would finish only with the last read-ahead; in order, it finishes first. The depth
        covers the gaps between the polls that refill it (the engine's hooks)."""
        while True:
            with self._backlog_lock:
                if not self._backlog[op] or self._in_ring[op] >= self._ring_depth:
                    return
                w = self._backlog[op].popleft()
                self._in_ring[op] += 1
            try:
                # On the ring a transfer has no thread to time it: the range marks its submission.
                with profiled("ssdtrain.write" if op == _uring.OP_WRITE else "ssdtrain.read"):
                    self._ring_send(w)
            except OSError as e:  # the kernel refused it: this window fails, like a failed transfer
                self._ring_done(w, -(e.errno or errno.EIO))

    def _ring_send(self, w: _RingWindow) -> None:
        self._ring.submit([(w.op, w.request.arena.fd_direct, w.address, w.length, w.offset, w)])

    def _ring_done(self, w: _RingWindow, res: int) -> None:
        """A window finished (on the thread that polled the ring)."""
        req = w.request
        res = _ring_result(w.op, res, w.length)
        err = None
        if 0 < res < w.length:  # short: the rest of the window goes again
            w.address, w.length, w.offset = w.address + res, w.length - res, w.offset + res
            try:
                self._ring_send(w)
                return
            except OSError as e:
                err = e
        elif res == 0:
            err = OSError(errno.EIO, "short write: the drive accepted no bytes" if w.op == _uring.OP_WRITE
                          else "short read: end of file")
        elif res < 0:
            err = OSError(-res, os.strerror(-res))
        with self._backlog_lock:
            self._in_ring[w.op] -= 1
        if err is not None and req.error is None:
            req.error = req.arena.error(req.what, w.payload, w.offset, err)
        req.left -= 1
        if req.left == 0:
            req.tensor = None
            if req.error is not None:
                req.future.set_exception(req.error)
            else:
                req.future.set_result([None] * req.windows)
        self._ring_pump(w.op)

    def poll(self) -> None:
        if self._ring is not None:
            self._ring.poll()

    def needs_poll(self) -> bool:
        ring = self._ring
        return ring is not None and (ring.in_flight > 0 or ring.has_ready())

    def wait_any(self) -> None:
        if self._ring is not None:
            self._ring.wait()

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
        if self._on_ring(arena, src, checksum):
            try:
                out = self._ring_submit("write", arena, src, extent.offset, lead, extent.nbytes, ready)
            except BaseException:
                self._settle(arena, extent.nbytes, written=False)
                raise
            out.add_done_callback(lambda f: self._settle(arena, extent.nbytes, written=f.exception() is None))
            return out
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
        if in_place and self._on_ring(arena, dst, checksum):
            out = self._ring_submit("read", arena, dst, extent.offset, lead, extent.nbytes, ready)
            self._count_read(arena, out, extent.nbytes)
            return out
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


class _RingFuture(Future):
    """A future that the ring completes: waiting on it polls the ring, so it needs no thread."""

    def __init__(self, ring: _uring.Ring) -> None:
        super().__init__()
        self._ring = ring
        self.set_running_or_notify_cancel()

    def _drive(self, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.done():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return
            # Untimed, block in the ring; timed, only poll it, so that the deadline holds.
            if self._ring.wait() if left is None else self._ring.poll():
                continue
            # Nothing came: another thread reaped it and runs its callbacks now, or it was never
            # submitted (then the ring is empty). Wait on the future itself, briefly.
            try:
                super().exception(timeout=0.01 if left is None else min(left, 0.001))
            except TimeoutError:
                pass

    def result(self, timeout: float | None = None):
        self._drive(timeout)
        return super().result(timeout=0 if timeout is not None else None)

    def exception(self, timeout: float | None = None):
        self._drive(timeout)
        return super().exception(timeout=0 if timeout is not None else None)


class _RingRequest:
    __slots__ = ("future", "arena", "tensor", "what", "windows", "left", "error")

    def __init__(self, future: Future, arena: _Arena, tensor: torch.Tensor, what: str, windows: int) -> None:
        self.future, self.arena, self.tensor, self.what = future, arena, tensor, what
        self.windows = self.left = windows
        self.error: BaseException | None = None


class _RingWindow:
    __slots__ = ("request", "op", "address", "length", "offset", "payload")

    def __init__(self, request: _RingRequest, op: int, address: int, length: int, offset: int, payload: int) -> None:
        self.request, self.op, self.address, self.length, self.offset, self.payload = (
            request, op, address, length, offset, payload)


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
