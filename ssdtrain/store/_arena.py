"""What the file backends (posix, kvikio) share: arenas, striping, extents, deferred trim, counters.

An arena is one unlinked file on one path with its allocator. A backend built on this class keeps
``self._arenas`` (objects with ``index``, ``path``, ``lock``, ``alloc``, ``leads``, ``queued``,
``written``, ``read``, ``trimming``, ``direct``, ``pool`` and ``fileno()``) and does the I/O.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import threading
from collections.abc import Callable, Iterator

import torch

from ssdtrain.store import _fs
from ssdtrain.store._hostbuf import HostBufferPool
from ssdtrain.store.allocator import ExtentAllocator
from ssdtrain.store.base import ALIGN, Backend, Extent

log = logging.getLogger(__name__)

TRIM_AFTER_SECONDS = 60.0
"""Arena space that stays free this long is punched, so that the drive can trim it."""
TRIM_BATCH_BYTES = 256 << 20
"""At most this much is punched per trim task (punching stalls direct I/O on the file)."""


class Arena:
    """What every arena holds besides its file: allocator, counters, page leads of extents."""

    def __init__(self, index: int, path: str) -> None:
        self.index = index
        self.path = path
        self.lock = threading.Lock()
        self.alloc = ExtentAllocator(ALIGN)
        self.leads: dict[int, int] = {}  # extent offset -> its payload's offset within the first page
        self.queued = 0
        self.written = 0
        self.read = 0
        self.trimming = False
        self.created: list[str] = []  # directories made for ``path`` (removed if opening fails)

    def forget(self) -> None:
        """In a forked child: closes this process's copies of the arena's descriptors without
        waiting for anything (Note [an offloader does not cross a fork] in ``base.py``).
        Backends whose file is not a plain descriptor of theirs keep the default: nothing."""


# Note [nothing left on disk]
# The arena is reachable only through our file descriptors. Where the filesystem allows it
# (Linux >= 3.11: ext4, xfs, btrfs, tmpfs, ...) it is an O_TMPFILE file: it never has a name, so
# nothing is visible under ``path`` at any moment, even to a SIGKILL between two syscalls, and
# O_EXCL keeps it from ever being linked in. Elsewhere it is created O_EXCL, 0600, in a fresh
# private directory (0700) and both are removed right after opening, before anything slow (the
# O_DIRECT test write): only a kill between those few syscalls can leave the empty pair behind.
# Either way the kernel frees the blocks when the last descriptor closes, two offloaders or
# processes can never open each other's arena, and nothing is followed through a symlink (mkdir
# refuses any existing name). A second descriptor (O_DIRECT) is opened through
# ``/proc/self/fd``, never through a name.
_NO_TMPFILE = frozenset({errno.EOPNOTSUPP, errno.ENOTSUP, errno.EISDIR, errno.EINVAL, errno.ENOSYS})


def open_unnamed(path: str) -> int:
    """A new, empty file on ``path``'s filesystem that no name leads to (Note [nothing left on
    disk]): read-write, mode 0600, close-on-exec.

    Raises:
        OSError: the file cannot be created (no permission, no space, read-only filesystem).
        ValueError: the fallback's private directory exists already or cannot be made.
    """
    flags = os.O_RDWR | getattr(os, "O_CLOEXEC", 0)
    o_tmpfile = getattr(os, "O_TMPFILE", 0)
    if o_tmpfile:
        try:
            return os.open(path, o_tmpfile | os.O_EXCL | flags, 0o600)
        except OSError as e:
            if e.errno not in _NO_TMPFILE:
                raise
    with private_name(path) as name:
        return os.open(name, flags | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)


@contextlib.contextmanager
def private_name(path: str) -> Iterator[str]:
    """A fresh file name in a new private directory under ``path``; both are gone on exit."""
    private = os.path.join(path, f"ssdtrain-{os.getpid()}-{secrets.token_hex(6)}")
    try:
        os.mkdir(private, 0o700)
    except FileExistsError as e:
        raise ValueError(f"{private!r} already exists; refusing to use or follow it") from e
    except OSError as e:
        raise ValueError(f"cannot create a directory in path={path!r} ({e.strerror})") from e
    name = os.path.join(private, "arena")
    try:
        yield name
    finally:
        for undo in (lambda: os.unlink(name), lambda: os.rmdir(private)):
            try:
                undo()
            except FileNotFoundError:
                pass


class ArenaBackend(Backend):
    """Placement and bookkeeping over ``self._arenas``; subclasses open them and move the bytes."""

    def __init__(self, pool_bytes: int) -> None:
        self._arenas: list = []
        self._pool = HostBufferPool(pool_bytes)
        self._place_lock = threading.Lock()
        self._closed = False
        self._watch_fork()

    def _open_arenas(self, paths: tuple[str, ...], make: Callable[[int, str], object]) -> None:
        """Opens one arena per path (closing those opened if one fails), then warns about RAM."""
        try:
            for i, p in enumerate(paths):
                self._arenas.append(make(i, p))
        except BaseException:
            self.close()
            # A refused path leaves no directory that this call made (an arena that failed
            # removed its own).
            for a in reversed(self._arenas):
                _fs.remove_dirs(a.created)
            raise
        self._warn_ram_backed()

    def _after_fork_in_child(self) -> None:
        super()._after_fork_in_child()
        for a in self._arenas:
            try:
                a.forget()
            except OSError:  # our copy of a descriptor: nothing is left to do about it here
                pass

    def close(self) -> None:
        """Waits for I/O in flight (each arena's pools) and closes the files; idempotent. In a
        forked child it only marks the backend closed (the files were closed at the fork)."""
        if self._closed:
            return
        self._closed = True
        if not self._forked:
            for a in self._arenas:
                a.close()
        self._pool.close()

    def _warn_ram_backed(self) -> None:
        for a in self._arenas:
            if _fs.is_ram_backed(a.path):
                log.warning("ssdtrain: %s is RAM-backed (%s): offloading there saves no memory",
                            a.path, _fs.fs_type(a.path))

    def allocate(self, nbytes: int) -> Extent:
        self._check_process()
        with self._place_lock:
            # Stripe by load: the path with the fewest bytes waiting gets the next extent.
            arena = min(self._arenas, key=lambda a: (a.queued, a.alloc.used_bytes))
            with arena.lock:
                # One spare page: a host tensor's payload starts at its lead within the first page.
                offset, length = arena.alloc.allocate(max(nbytes, 1) + (ALIGN if arena.direct else 0))
        return Extent(arena.index, offset, nbytes, length)

    def heal(self) -> None:
        """Note [leaked, never doubly held]: repairs an allocator that an interrupt tore."""
        for arena in self._arenas:
            with arena.lock:
                if not arena.alloc.consistent():
                    arena.alloc.heal()

    def free(self, extent: Extent) -> None:
        self._check_process()
        arena = self._arenas[extent.path_index]
        with arena.lock:
            arena.leads.pop(extent.offset, None)
            arena.alloc.free(extent.offset, extent.length)
            # Note [trim what stays free]: no punch here (on the main thread, stalling every direct
            # I/O in flight on the file, for space the next step overwrites anyway).
            if self._closed or arena.trimming or not arena.alloc.trim_due(TRIM_AFTER_SECONDS):
                return
            ranges = arena.alloc.begin_trim(TRIM_AFTER_SECONDS, max_bytes=TRIM_BATCH_BYTES)
            arena.trimming = True
        try:
            arena.pool.submit(self._punch, arena, ranges)
        except RuntimeError:  # the pool is shutting down
            self._punched(arena, ranges)

    def _punch(self, arena, ranges: list[tuple[int, int]]) -> None:
        try:
            for off, length in ranges:
                if not _fs.punch_hole(arena.fileno(), off, length):
                    break
        except OSError as e:
            log.warning("ssdtrain: could not punch a hole in the arena on %s: %s", arena.path, e)
        finally:
            self._punched(arena, ranges)

    def _punched(self, arena, ranges: list[tuple[int, int]]) -> None:
        with arena.lock:
            arena.alloc.end_trim(ranges)
            arena.trimming = False

    def alloc_buffer(self, nbytes: int, device: torch.device, extent: Extent | None = None) -> torch.Tensor:
        """A reload buffer; given the extent it will receive, one that the read fills in place
        (reused memory, Note [reuse reload memory]); a plain one for a GPU."""
        self._check_process()
        if device.type != "cpu":
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
        return self._pool.take(nbytes, 0 if extent is None else self._lead(extent))

    def _lead(self, extent: Extent) -> int:
        """Where the extent's payload starts within its first page (as in the written tensor)."""
        arena = self._arenas[extent.path_index]
        with arena.lock:
            return arena.leads.get(extent.offset, 0)

    def _count_read(self, arena, fut, nbytes: int) -> None:
        def count(f) -> None:
            if f.exception() is None:
                with arena.lock:
                    arena.read += nbytes
        fut.add_done_callback(count)

    def _settle(self, arena, nbytes: int, *, written: bool) -> None:
        with arena.lock:
            arena.queued -= nbytes
            if written:
                arena.written += nbytes

    def written_bytes_by_path(self) -> dict[str, int]:
        return {a.path: a.written for a in self._arenas}

    def read_bytes_by_path(self) -> dict[str, int]:
        return {a.path: a.read for a in self._arenas}
