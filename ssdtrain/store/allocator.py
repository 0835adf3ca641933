"""Extents in one arena file: aligned, reused after free, and the file's end pulled back.

The arena is a single file per path. :class:`ExtentAllocator` only does the arithmetic: which
byte range of that file a new extent gets, and which ranges are free again (so that the backend
can punch holes in them and let the drive trim). It owns no file and no lock.

Policy: best fit among the free ranges below ``end`` (the smallest range that is large enough,
lowest offset on ties), else grow ``end``. Freed ranges coalesce with their free neighbours; a
free range that reaches ``end`` is dropped and ``end`` shrinks, so an arena whose extents are all
freed has ``end == 0`` again.
"""

from __future__ import annotations

import bisect

__all__ = ["ExtentAllocator"]


class ExtentAllocator:
    """Hands out ``alignment``-aligned byte ranges of an arena and takes them back.

    Not thread-safe: the backend holds its lock around every call.

    Zero-byte requests get ``(0, 0)``, which occupies nothing; freeing a zero-length range is a
    no-op. Misuse (freeing what was never allocated, twice, or with a different length) raises
    ``ValueError``: it would otherwise hand the same bytes to two tensors.

    Args:
        alignment: every offset and length is a multiple of this (a power of two, >= 1).
    """

    def __init__(self, alignment: int = 4096) -> None:
        if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1):
            raise ValueError(f"alignment={alignment!r} must be a power of two >= 1 (e.g. 4096)")
        self._align = alignment
        self._end = 0
        self._used = 0
        self._allocated: dict[int, int] = {}  # offset -> length of each live extent
        self._free_starts: list[int] = []  # sorted offsets of free ranges below end
        self._free_len: dict[int, int] = {}  # offset -> length of each free range
        self._free_total = 0

    @property
    def alignment(self) -> int:
        return self._align

    @property
    def end(self) -> int:
        """High-water mark: every live extent lies below it; the arena file need not be longer."""
        return self._end

    @property
    def used_bytes(self) -> int:
        """Bytes held by live extents (aligned lengths)."""
        return self._used

    @property
    def free_bytes(self) -> int:
        """Free bytes below ``end`` (holes that later allocations reuse)."""
        return self._free_total

    def free_ranges(self) -> list[tuple[int, int]]:
        """The free ``(offset, length)`` ranges below ``end``, in offset order (coalesced)."""
        return [(s, self._free_len[s]) for s in self._free_starts]

    def allocate(self, nbytes: int) -> tuple[int, int]:
        """Reserves room for ``nbytes``.

        Returns:
            ``(offset, length)``: ``length`` is ``nbytes`` rounded up to the alignment and
            ``offset`` is aligned.
        """
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"nbytes={nbytes!r} must be an integer >= 0")
        if nbytes == 0:
            return (0, 0)
        length = -(-nbytes // self._align) * self._align
        best = None
        best_len = 0
        for start in self._free_starts:
            flen = self._free_len[start]
            if flen >= length and (best is None or flen < best_len):
                best, best_len = start, flen
                if flen == length:
                    break
        if best is None:
            offset = self._end
            self._end += length
        else:
            offset = best
            self._remove_free(best)
            if best_len > length:
                self._insert_free(best + length, best_len - length)
        self._allocated[offset] = length
        self._used += length
        return (offset, length)

    def free(self, offset: int, length: int) -> list[tuple[int, int]]:
        """Gives back an extent returned by :meth:`allocate`.

        ``length`` may be the aligned length or the ``nbytes`` originally asked for.

        Returns:
            The ``(offset, length)`` ranges that became free and may be hole-punched.

        Raises:
            ValueError: the range was not allocated (never, already freed, or another length).
        """
        if length == 0:
            return []
        aligned = -(-length // self._align) * self._align if length > 0 else length
        have = self._allocated.get(offset)
        if have is None or have != aligned:
            if have is None:
                why = "was never allocated or is already free"
            else:
                why = f"was allocated with length {have}"
            raise ValueError(f"cannot free extent (offset={offset}, length={length}): it {why}")
        del self._allocated[offset]
        self._used -= have

        start, stop = offset, offset + have
        i = bisect.bisect_left(self._free_starts, start)
        if i > 0:
            prev = self._free_starts[i - 1]
            if prev + self._free_len[prev] == start:
                start = prev
                self._remove_free(prev)
        nxt = stop
        if nxt in self._free_len:
            stop = nxt + self._free_len[nxt]
            self._remove_free(nxt)
        if stop == self._end:
            self._end = start
        else:
            self._insert_free(start, stop - start)
        return [(offset, have)]

    def _insert_free(self, start: int, length: int) -> None:
        bisect.insort(self._free_starts, start)
        self._free_len[start] = length
        self._free_total += length

    def _remove_free(self, start: int) -> None:
        i = bisect.bisect_left(self._free_starts, start)
        del self._free_starts[i]
        self._free_total -= self._free_len.pop(start)

    def __repr__(self) -> str:
        return (
            f"ExtentAllocator(end={self._end}, used={self._used}, free={self._free_total}, "
            f"extents={len(self._allocated)}, holes={len(self._free_starts)})"
        )
