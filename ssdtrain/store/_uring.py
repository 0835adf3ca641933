"""A minimal io_uring in pure Python (ctypes): direct reads and writes with no I/O thread.

Note [I/O without threads]
With O_DIRECT, a read or write submitted through io_uring goes to the drive from the calling
thread's system call and completes by interrupt: no thread of ours wakes up for it. On a machine
whose cores all compute (torch runs one intra-op thread per core), every wake-up of a Python I/O
thread preempts a compute thread, takes the GIL from the training loop and leaves the other
compute thread waiting at the op's barrier; measured here that cost more than the I/O threads'
own CPU time (see the posix backend's ``io_engine``). The engine therefore submits from whichever
thread calls it and reaps completions where it already stops by: its hooks, its waits, and a
future's ``result()``.

Scope, deliberately small: ``IORING_OP_READ`` / ``IORING_OP_WRITE`` on plain file descriptors,
one ring per backend, no registered files or buffers, no SQPOLL (it would spend a core).
The rings are mapped shared memory written with plain stores, so this relies on x86's ordering
(stores are seen in program order; a load is not moved before an earlier one): ``available()``
is false elsewhere, and the backend then uses threads.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import platform
import struct
import threading
from collections import deque
from collections.abc import Callable

__all__ = ["Ring", "available", "unavailable_reason"]

_SYS_SETUP, _SYS_ENTER = 425, 426  # the same numbers on x86_64 and aarch64
_OFF_SQ_RING, _OFF_CQ_RING, _OFF_SQES = 0, 0x8000000, 0x10000000
_FEAT_SINGLE_MMAP = 1 << 0
_SETUP_COOP_TASKRUN = 1 << 8  # completions are not pushed to the submitter with an IPI
_ENTER_GETEVENTS = 1 << 0
OP_READ, OP_WRITE = 22, 23
_SQE = struct.Struct("<BBHiQQIIQHHiQQ")  # struct io_uring_sqe, 64 bytes
_CQE = struct.Struct("<QiI")  # struct io_uring_cqe, 16 bytes
assert _SQE.size == 64 and _CQE.size == 16


class _Params(ctypes.Structure):
    _fields_ = [("sq_entries", ctypes.c_uint32), ("cq_entries", ctypes.c_uint32), ("flags", ctypes.c_uint32),
                ("sq_thread_cpu", ctypes.c_uint32), ("sq_thread_idle", ctypes.c_uint32),
                ("features", ctypes.c_uint32), ("wq_fd", ctypes.c_uint32), ("resv", ctypes.c_uint32 * 3),
                # io_sqring_offsets: head tail ring_mask ring_entries flags dropped array resv1 user_addr(u64)
                ("sq_off", ctypes.c_uint32 * 10),
                # io_cqring_offsets: head tail ring_mask ring_entries overflow cqes flags resv1 user_addr(u64)
                ("cq_off", ctypes.c_uint32 * 10)]


_libc = None
_reason: str | None = None
_probed = False


def _syscall():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.syscall.restype = ctypes.c_long
    return _libc.syscall


def unavailable_reason() -> str | None:
    """Why :class:`Ring` cannot be used here (``None`` when it can). Probed once, on first call."""
    global _probed, _reason
    if not _probed:
        _probed = True
        if platform.machine().lower() not in ("x86_64", "amd64"):
            _reason = f"the pure-Python ring relies on x86 memory ordering; this is {platform.machine()}"
        elif not hasattr(os, "O_DIRECT"):
            _reason = "not Linux"
        else:
            try:
                Ring(2).close()
            except OSError as e:
                _reason = f"io_uring_setup failed: {e.strerror or e}"
    return _reason


def available() -> bool:
    return unavailable_reason() is None


class Ring:
    """One io_uring: ``submit`` reads and writes, ``poll`` or ``wait`` for their completions.

    Thread-safe. Completions are handed to ``on_complete(token, result)`` by the thread that
    calls ``poll`` or ``wait``, outside the ring's lock (it may submit again); ``submit`` never
    calls it. ``result`` is the byte count or ``-errno``, as the kernel gives it.
    """

    def __init__(self, entries: int = 256, on_complete: Callable[[object, int], None] | None = None) -> None:
        sys = _syscall()
        p = _Params()
        p.flags = _SETUP_COOP_TASKRUN
        fd = sys(_SYS_SETUP, entries, ctypes.byref(p))
        if fd < 0 and ctypes.get_errno() == errno.EINVAL:  # kernels before 5.19: no COOP_TASKRUN
            p = _Params()
            fd = sys(_SYS_SETUP, entries, ctypes.byref(p))
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        self.fd = fd
        self._on_complete = on_complete
        self._lock = threading.Lock()
        self._tokens: dict[int, object] = {}
        self._next = 0
        self._ready: deque = deque()
        try:
            so, co = p.sq_off, p.cq_off
            sq_size = so[6] + p.sq_entries * 4
            cq_size = co[5] + p.cq_entries * _CQE.size
            if p.features & _FEAT_SINGLE_MMAP:
                sq_size = cq_size = max(sq_size, cq_size)
            self._sq_mm = mmap.mmap(fd, sq_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE,
                                    offset=_OFF_SQ_RING)
            self._cq_mm = self._sq_mm if p.features & _FEAT_SINGLE_MMAP else mmap.mmap(
                fd, cq_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=_OFF_CQ_RING)
            self._sqes = mmap.mmap(fd, p.sq_entries * _SQE.size, mmap.MAP_SHARED,
                                   mmap.PROT_READ | mmap.PROT_WRITE, offset=_OFF_SQES)
        except BaseException:
            os.close(fd)
            raise
        u32 = ctypes.c_uint32
        self._sq_head = u32.from_buffer(self._sq_mm, so[0])
        self._sq_tail = u32.from_buffer(self._sq_mm, so[1])
        self._sq_mask = u32.from_buffer(self._sq_mm, so[2]).value
        self._sq_array = (u32 * p.sq_entries).from_buffer(self._sq_mm, so[6])
        self._cq_head = u32.from_buffer(self._cq_mm, co[0])
        self._cq_tail = u32.from_buffer(self._cq_mm, co[1])
        self._cq_mask = u32.from_buffer(self._cq_mm, co[2]).value
        self._cqes_off = co[5]
        self.entries = p.sq_entries
        self.cq_entries = p.cq_entries
        self.in_flight = 0

    # -- submission ---------------------------------------------------------------------------
    def submit(self, ops: list[tuple[int, int, int, int, int, object]]) -> None:
        """Submits ``(opcode, fd, address, length, offset, token)`` operations, in order, each
        with its own system call.

        Waits for room while the CQ ring is full (completions are then only set aside for the
        next poll: this caller may hold locks that their callbacks take). Raises ``OSError`` if
        the kernel refuses an operation; that one is not in flight, those before it are.
        """
        for op in ops:
            while True:
                with self._lock:
                    # The kernel may hold more completions than the CQ ring (an overflow list
                    # since 5.5), but do not count on it: never more in flight than it holds.
                    if self.in_flight < self.cq_entries:
                        self._push_locked(op)
                        break
                self._collect(block=True)

    def _push_locked(self, op: tuple[int, int, int, int, int, object]) -> None:
        tail = self._sq_tail.value
        idx = tail & self._sq_mask
        key = self._next
        self._next += 1
        _SQE.pack_into(self._sqes, idx * _SQE.size, op[0], 0, 0, op[1], op[4], op[2], op[3], 0, key, 0, 0, 0, 0, 0)
        self._sq_array[idx] = idx
        self._sq_tail.value = tail + 1  # x86: seen after the entry (Note [I/O without threads])
        while True:
            n = _syscall()(_SYS_ENTER, self.fd, 1, 0, 0, None, 0)
            if n == 1:
                break
            err = ctypes.get_errno() if n < 0 else errno.EAGAIN
            if err not in (errno.EINTR, errno.EAGAIN, errno.EBUSY):
                self._sq_tail.value = tail  # not consumed: take it back
                raise OSError(err, f"io_uring_enter: {os.strerror(err)}")
        self._tokens[key] = op[5]
        self.in_flight += 1

    # -- completion ---------------------------------------------------------------------------
    def _collect(self, *, block: bool) -> None:
        """Moves posted completions to the ready list (waiting for one first with ``block``),
        without running any callback."""
        if block and self.in_flight and self._cq_head.value == self._cq_tail.value:
            r = _syscall()(_SYS_ENTER, self.fd, 0, 1, _ENTER_GETEVENTS, None, 0)
            if r < 0 and ctypes.get_errno() not in (errno.EINTR, errno.EAGAIN, errno.EBUSY):
                err = ctypes.get_errno()
                raise OSError(err, f"io_uring_enter: {os.strerror(err)}")
        n = 0
        with self._lock:
            head, tail = self._cq_head.value, self._cq_tail.value
            while head != tail:
                key, res, _ = _CQE.unpack_from(self._cq_mm, self._cqes_off + (head & self._cq_mask) * _CQE.size)
                self._ready.append((self._tokens.pop(key), res))
                head += 1
                n += 1
            self._cq_head.value = head
            self.in_flight -= n

    def has_ready(self) -> bool:
        """Completions reaped but not yet handed to ``on_complete``."""
        return bool(self._ready)

    def _run_ready(self) -> int:
        n = 0
        while True:
            try:
                token, res = self._ready.popleft()
            except IndexError:
                return n
            n += 1
            if self._on_complete is not None:
                self._on_complete(token, res)

    def poll(self) -> int:
        """Hands every completion posted so far to ``on_complete`` (after a cheap system call
        that runs the kernel's pending completion work, when something is in flight); returns
        how many. Call it where no lock that ``on_complete`` takes is held."""
        if self.in_flight:
            _syscall()(_SYS_ENTER, self.fd, 0, 0, _ENTER_GETEVENTS, None, 0)
        self._collect(block=False)
        return self._run_ready()

    def wait(self) -> int:
        """Like :meth:`poll`, but first blocks (GIL released) until a completion is posted, if
        none is ready and anything is in flight."""
        while not self._ready and self.in_flight:
            self._collect(block=True)
        return self._run_ready()

    def close(self) -> None:
        """Waits for what is in flight (its memory must not be reused under it), then unmaps."""
        while self.in_flight:
            self.wait()
        if self.fd < 0:
            return
        del self._sq_head, self._sq_tail, self._sq_array, self._cq_head, self._cq_tail
        for m in {id(x): x for x in (self._sq_mm, self._cq_mm, self._sqes)}.values():
            m.close()
        os.close(self.fd)
        self.fd = -1
