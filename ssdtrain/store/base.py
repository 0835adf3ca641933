"""What every storage backend offers the engine: extents, and asynchronous writes and reads.

The engine (``ssdtrain/engine/offloader.py``) never touches a file: it asks a backend for an extent,
submits a write of a tensor's bytes into it, later submits a read back, and frees the extent
when the last saved reference to it dies. Backends own their threads and their parallelism
(``chunk_bytes`` requests, ``io_threads`` per path).
"""

from __future__ import annotations

import abc
import dataclasses
import os
import weakref
from collections.abc import Callable
from concurrent.futures import Future

import torch

__all__ = ["Backend", "Extent", "StorageError", "ChecksumError", "ALIGN", "on_drive"]

ALIGN = 4096
"""Every extent starts on, and is padded to, this many bytes: what O_DIRECT and GDS need."""


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


class StorageError(OSError):
    """A write or read on the offload storage failed (full drive, I/O error, short transfer)."""


class ChecksumError(StorageError):
    """Data read back does not match the checksum taken when it was written."""


@dataclasses.dataclass(frozen=True)
class Extent:
    """A place in one arena: ``nbytes`` of payload at ``offset``, ``length`` (aligned) reserved."""

    path_index: int
    offset: int
    nbytes: int
    length: int


def on_drive(extent: object) -> bool:
    """Whether ``extent`` holds drive space: a host tier's extent has ``path_index`` -1 (its
    copies are not a drive's writes); an extent with no ``path_index`` counts as a drive's."""
    return getattr(extent, "path_index", 0) >= 0


# Note [an offloader does not cross a fork]
# A forked child (a DataLoader worker, multiprocessing with "fork") inherits the arena
# descriptors but none of the I/O threads. Kept open there, the descriptors hold the arena's
# blocks on the drive for as long as the child lives, after the trainer closed or died; used
# there, a write or read would queue work that no thread runs (a hang), and share the parent's
# file offsets and extents. So in the child every live backend closes its copies of the
# descriptors at once (without waiting for anything) and refuses every later call with a
# RuntimeError that says what to do. The handler is registered with ``os.register_at_fork`` when
# the first backend is made (import registers nothing) and reaches the backends through a
# WeakSet: process-wide state, because a fork is.
_live_backends: weakref.WeakSet = weakref.WeakSet()
_fork_handler_registered = False


def _after_fork_in_child() -> None:
    for backend in list(_live_backends):
        backend._after_fork_in_child()


class Backend(abc.ABC):
    """A store of extents. Thread-safe: the engine calls it from the main and I/O threads.

    A backend belongs to the process that made it: in a forked child every method but
    :meth:`close` raises ``RuntimeError`` (Note [an offloader does not cross a fork]).
    """

    name: str = "?"
    _owner_pid: int | None = None
    _forked = False

    def _watch_fork(self) -> None:
        """Called by a backend's ``__init__``: it is cut off in forked children from now on."""
        global _fork_handler_registered
        self._owner_pid = os.getpid()
        _live_backends.add(self)
        if not _fork_handler_registered and hasattr(os, "register_at_fork"):
            _fork_handler_registered = True
            os.register_at_fork(after_in_child=_after_fork_in_child)

    def _after_fork_in_child(self) -> None:
        """Runs in the child right after a fork (one thread, must not block): closes this
        process's copies of files and marks the backend unusable. Subclasses extend it."""
        self._forked = True

    def _check_process(self) -> None:
        """Raises ``RuntimeError`` in a forked child."""
        if self._forked:
            raise RuntimeError(
                f"ssdtrain: this Offloader was created in process {self._owner_pid} and cannot be used in a "
                f"forked child (process {os.getpid()}): its I/O threads do not exist here and its files were "
                "closed at the fork. Create a new Offloader in the child (or use the 'spawn' start method)")

    @abc.abstractmethod
    def allocate(self, nbytes: int) -> Extent:
        """Reserves room for ``nbytes``; chooses the path (striping) itself."""

    @abc.abstractmethod
    def free(self, extent: Extent) -> None:
        """Gives the extent back (and lets the drive trim it)."""

    @abc.abstractmethod
    def submit_write(
        self, extent: Extent, src: torch.Tensor, *, checksum: bool = False, ready: Callable[[], None] | None = None
    ) -> Future:
        """Writes ``src`` (1-D contiguous uint8, ``extent.nbytes`` long) into the extent.

        ``ready``, when given, is called on the I/O thread before ``src`` is read: on a GPU it
        waits for the stream that produced the tensor (Note [write waits for the producer]).

        The future's result is an opaque checksum record (``None`` unless ``checksum``); it fails
        with :class:`StorageError` when the data could not be written completely.
        ``src`` must stay alive and unmodified until the future is done.
        """

    @abc.abstractmethod
    def submit_read(
        self, extent: Extent, dst: torch.Tensor, *, checksum: object = None, ready: Callable[[], None] | None = None
    ) -> Future:
        """Reads the extent into ``dst`` (1-D contiguous uint8, ``extent.nbytes`` long).

        ``ready``, when given, is called on the I/O thread before ``dst`` is written (on a GPU:
        the compute stream is done with whatever used that memory before). The future completes
        only when the bytes are in ``dst`` (Note [reload visible after its read]).

        With a checksum record from the write, the data is verified and the future fails with
        :class:`ChecksumError` on a mismatch. A failed read never leaves ``dst`` looking valid:
        the future fails.
        """

    def alloc_buffer(self, nbytes: int, device: torch.device, extent: Extent | None = None) -> torch.Tensor:
        """A destination for :meth:`submit_read`; given the ``extent`` it will receive, backends
        may lay it out so that the read lands in place (direct I/O without a copy)."""
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def written_bytes_by_path(self) -> dict[str, int]:
        return {}

    def heal(self) -> None:
        """Repairs bookkeeping that an interrupt on the training thread cut short; called by
        ``Offloader.wait()`` once no I/O is in flight. Nothing to do by default."""

    def describe(self) -> str:
        """One line for logs and stats: backend, paths, direct I/O or not."""
        return self.name

    @abc.abstractmethod
    def close(self) -> None:
        """Waits for I/O in flight, closes files; idempotent."""
