"""What every storage backend offers the engine: extents, and asynchronous writes and reads.

The engine (``ssdtrain/offloader.py``) never touches a file: it asks a backend for an extent,
submits a write of a tensor's bytes into it, later submits a read back, and frees the extent
when the last saved reference to it dies. Backends own their threads and their parallelism
(``chunk_bytes`` requests, ``io_threads`` per path).
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable
from concurrent.futures import Future

import torch

__all__ = ["Backend", "Extent", "StorageError", "ChecksumError", "ALIGN"]

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


class Backend(abc.ABC):
    """A store of extents. Thread-safe: the engine calls it from the main and I/O threads."""

    name: str = "?"

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

    def describe(self) -> str:
        """One line for logs and stats: backend, paths, direct I/O or not."""
        return self.name

    @abc.abstractmethod
    def close(self) -> None:
        """Waits for I/O in flight, closes files; idempotent."""
