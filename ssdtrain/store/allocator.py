"""Extents in one arena file: aligned, reused after free, and the file's end pulled back.

The arena is a single file per path. :class:`ExtentAllocator` only does the arithmetic: which
byte range of that file a new extent gets, and which ranges are free again (so that the backend
can punch holes in them and let the drive trim). It owns no file and no lock.

Policy: best fit among the free ranges below ``end`` (the smallest range that is large enough,
lowest offset on ties), else grow ``end``. Freed ranges coalesce with their free neighbours; a
free range that reaches ``end`` is dropped and ``end`` shrinks, so an arena whose extents are all
freed has ``end == 0`` again.

Note [trim what stays free]
Punching a hole costs far more than its syscall suggests: the filesystem first waits for every
direct I/O in flight on the file (``inode_dio_wait``) and blocks new ones meanwhile, a
``discard`` mount sends the trim to the drive at once, and the next write into the hole must
allocate blocks again (slower than an overwrite). Training frees and reuses the same space every
step, where a punch buys nothing: an overwrite invalidates the old flash pages anyway. So the
allocator also remembers which freed bytes have not been punched yet ("untrimmed"); reusing them
clears that, and :meth:`begin_trim` hands out only what has *stayed* free for a while, reserved
so that no extent can land there while the caller punches it off the critical path;
:meth:`end_trim` returns it. Callers that prefer to punch at once can use :meth:`free`'s result.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterable

__all__ = ["ExtentAllocator"]


class ExtentAllocator:
    """Hands out ``alignment``-aligned byte ranges of an arena and takes them back.

    Not thread-safe: the backend holds its lock around every call.

    Zero-byte requests get ``(0, 0)``, which occupies nothing; freeing a zero-length range is a
    no-op. Misuse (freeing what was never allocated, twice, or with a different length) raises
    ``ValueError``: it would otherwise hand the same bytes to two tensors.

    Args:
        alignment: every offset and length is a multiple of this (a power of two, >= 1).
        clock: seconds, for the age of untrimmed ranges (tests pass a fake one).
    """

    def __init__(self, alignment: int = 4096, *, clock: Callable[[], float] = time.monotonic) -> None:
        if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1):
            raise ValueError(f"alignment={alignment!r} must be a power of two >= 1 (e.g. 4096)")
        self._align = alignment
        self._end = 0
        self._used = 0
        self._allocated: dict[int, int] = {}  # offset -> length of each live extent
        self._free_starts: list[int] = []  # sorted offsets of free ranges below end
        self._free_len: dict[int, int] = {}  # offset -> length of each free range
        self._free_total = 0
        self._clock = clock
        self._dirty = _RangeSet()  # freed, not reused, not punched: offset -> (length, freed at)
        self._trimming: set[int] = set()  # offsets of ranges reserved by begin_trim

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
        """Reserves room for ``nbytes`` (see :meth:`_allocate`); heals a torn state first."""
        try:
            return self._allocate(nbytes)
        except (KeyError, IndexError):  # an earlier change was cut short: Note [leaked, never doubly held]
            self.heal()
            return self._allocate(nbytes)

    def _allocate(self, nbytes: int) -> tuple[int, int]:
        """Reserves room for ``nbytes``.

        Returns:
            ``(offset, length)``: ``length`` is ``nbytes`` rounded up to the alignment and
            ``offset`` is aligned.
        """
        if type(nbytes) is not int or nbytes < 0:  # not a bool either (type, not isinstance: no call)
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
        self._dirty.remove(offset, length)  # about to be overwritten: no punch needed
        return (offset, length)

    def free(self, offset: int, length: int, *, trimmed: bool = False) -> list[tuple[int, int]]:
        """Gives back an extent returned by :meth:`allocate`.

        ``length`` may be the aligned length or the ``nbytes`` originally asked for. Pass
        ``trimmed=True`` when the caller punches the returned ranges itself (now or before any
        reuse); otherwise they count as untrimmed (Note [trim what stays free]).

        Returns:
            The ``(offset, length)`` ranges that became free and may be hole-punched.

        Raises:
            ValueError: the range was not allocated (never, already freed, or another length).
        """
        if length == 0:
            return []
        aligned = -(-length // self._align) * self._align if length > 0 else length
        have = self._allocated.get(offset)
        if offset in self._trimming:
            have = None  # reserved by begin_trim: only end_trim gives it back
        if have is None or have != aligned:
            if have is None:
                why = "was never allocated or is already free"
            else:
                why = f"was allocated with length {have}"
            raise ValueError(f"cannot free extent (offset={offset}, length={length}): it {why}")
        self._release_healing(offset, have)
        if not trimmed:
            try:
                self._dirty.add(offset, have, self._clock())
            except (KeyError, IndexError):
                self.heal()
        return [(offset, have)]

    def shrink(self, offset: int, length: int, *, trimmed: bool = False) -> list[tuple[int, int]]:
        """Gives back the tail of a live extent beyond its first ``length`` bytes (rounded up to
        the alignment): the extent is split in two (:meth:`split`) and the second freed as
        :meth:`free` frees it.

        Raises:
            ValueError: ``offset`` is not a live extent's, or ``length`` is not within it.
        """
        tail = self.split(offset, length)
        return [] if tail is None else self.free(*tail, trimmed=trimmed)

    def split(self, offset: int, length: int) -> tuple[int, int] | None:
        """Splits a live extent after its first ``length`` bytes (rounded up to the alignment)
        into two live extents; the second's ``(offset, length)``, None if nothing is left.

        Raises:
            ValueError: ``offset`` is not a live extent's, or ``length`` is not within it.
        """
        have = self._allocated.get(offset)
        keep = -(-length // self._align) * self._align if length > 0 else 0
        if have is None or offset in self._trimming or not 0 < keep <= have:
            raise ValueError(f"cannot shrink or split extent (offset={offset}) at {length} bytes: it holds {have}")
        if keep == have:
            return None
        # Note [leaked, never doubly held]: the extent is shortened before its tail becomes one of its
        # own; cut short between the two, the tail is leaked, not held twice
        self._allocated[offset] = keep
        self._allocated[offset + keep] = have - keep
        return offset + keep, have - keep

    def consistent(self) -> bool:
        """Whether the free ranges and counts agree with the live extents (cheap: sums only)."""
        return (len(self._free_starts) == len(self._free_len) and self._free_total == sum(self._free_len.values())
                and self._used == sum(self._allocated.values()) and self._dirty.consistent())

    def heal(self) -> None:
        """Derives the free ranges, ``end`` and the counts from the live extents again.

        Note [leaked, never doubly held]: every change here removes a range from one side before
        it adds it to the other (free lists, then ``_allocated``; or the reverse), so a change cut
        short -- a KeyboardInterrupt on the training thread -- leaves bytes in neither, never in
        both: the live extents (trim reservations among them) are the truth, and what lies
        between them below their end is free. Untrimmed ranges are kept where they are free.
        """
        starts: list[int] = []
        lens: dict[int, int] = {}
        pos = 0
        for off in sorted(self._allocated):
            if off > pos:
                starts.append(pos)
                lens[pos] = off - pos
            pos = max(pos, off + self._allocated[off])
        self._free_starts, self._free_len, self._end = starts, lens, pos
        self._free_total = sum(lens.values())
        self._used = sum(self._allocated.values())
        self._dirty = self._dirty.within([(s, lens[s]) for s in starts])

    @property
    def untrimmed_bytes(self) -> int:
        """Freed bytes not reused and not yet handed out by :meth:`begin_trim` (nor punched)."""
        return self._dirty.total

    def trim_due(self, min_age: float = 0.0) -> bool:
        """Whether some untrimmed range has stayed free for at least ``min_age`` seconds."""
        return self._dirty.oldest(self._clock()) >= min_age if self._dirty.total else False

    def begin_trim(self, min_age: float = 0.0, max_bytes: int | None = None) -> list[tuple[int, int]]:
        """Reserves the untrimmed ranges freed at least ``min_age`` seconds ago, for punching.

        Until :meth:`end_trim`, no allocation can overlap them (they count in ``used_bytes``),
        so the caller can punch without holding its lock. Ranges above ``end`` raise ``end``.

        Args:
            min_age: only ranges that stayed free this long (space the workload does not reuse).
            max_bytes: stop after about this many bytes (a range is never split).

        Returns:
            The reserved ``(offset, length)`` ranges, coalesced, in offset order.
        """
        try:
            picked = self._dirty.take(self._clock() - min_age, max_bytes)
        except (KeyError, IndexError):  # Note [leaked, never doubly held]
            self.heal()
            return []
        reserved = []
        for off, length in picked:
            try:
                self._reserve(off, length)
            except (KeyError, IndexError, ValueError):  # torn, or not free after all: not trimmed now
                self.heal()
                continue
            self._trimming.add(off)
            reserved.append((off, length))
        return reserved

    def end_trim(self, ranges: Iterable[tuple[int, int]]) -> None:
        """Returns ranges from :meth:`begin_trim` (punched or not) to the free space."""
        for off, length in ranges:
            if off not in self._trimming or self._allocated.get(off) != length:
                raise ValueError(f"end_trim({off}, {length}): not a range reserved by begin_trim")
            self._trimming.discard(off)
            self._release_healing(off, length)

    def _reserve(self, off: int, length: int) -> None:
        """Marks ``[off, off + length)`` -- free space, or above ``end`` -- as allocated."""
        stop = off + length
        if off >= self._end:
            if off > self._end:
                self._insert_free(self._end, off - self._end)
            self._end = stop
        else:
            i = bisect.bisect_right(self._free_starts, off) - 1
            start = self._free_starts[i] if i >= 0 else -1
            flen = self._free_len.get(start, 0)
            if start < 0 or stop > start + flen:
                raise ValueError(f"range ({off}, {length}) is not free")
            self._remove_free(start)
            if start < off:
                self._insert_free(start, off - start)
            if stop < start + flen:
                self._insert_free(stop, start + flen - stop)
        self._allocated[off] = length
        self._used += length

    def _release_healing(self, offset: int, have: int) -> None:
        try:
            self._release(offset, have)
        except (KeyError, IndexError):  # Note [leaked, never doubly held]: torn by an earlier cut
            self._allocated.pop(offset, None)
            self.heal()

    def _release(self, offset: int, have: int) -> None:
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
            f"extents={len(self._allocated)}, holes={len(self._free_starts)}, "
            f"untrimmed={self._dirty.total})"
        )


class _RangeSet:
    """Disjoint byte ranges, each with the time it was added; adjacent ranges merge (newest time)."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ranges: dict[int, tuple[int, float]] = {}  # start -> (length, time)
        self.total = 0

    def items(self) -> list[tuple[int, int, float]]:
        return [(s, *self._ranges[s]) for s in self._starts]

    def _put(self, start: int, length: int, t: float) -> None:
        bisect.insort(self._starts, start)
        self._ranges[start] = (length, t)
        self.total += length

    def _pop(self, start: int) -> tuple[int, float]:
        del self._starts[bisect.bisect_left(self._starts, start)]
        length, t = self._ranges.pop(start)
        self.total -= length
        return length, t

    def add(self, start: int, length: int, t: float) -> None:
        stop = start + length
        i = bisect.bisect_left(self._starts, start)
        if i > 0:
            prev = self._starts[i - 1]
            plen, pt = self._ranges[prev]
            if prev + plen >= start:
                self._pop(prev)
                start, stop, t = prev, max(stop, prev + plen), max(t, pt)
        while True:
            i = bisect.bisect_left(self._starts, start)
            if i >= len(self._starts) or self._starts[i] > stop:
                break
            nxt = self._starts[i]
            nlen, nt = self._pop(nxt)
            stop, t = max(stop, nxt + nlen), max(t, nt)
        self._put(start, stop - start, t)

    def remove(self, start: int, length: int) -> None:
        if not self.total:
            return
        stop = start + length
        i = max(bisect.bisect_right(self._starts, start) - 1, 0)
        while i < len(self._starts) and self._starts[i] < stop:
            s = self._starts[i]
            slen, t = self._ranges[s]
            if s + slen <= start:
                i += 1
                continue
            self._pop(s)
            if s < start:
                self._put(s, start - s, t)
                i += 1
            if s + slen > stop:
                self._put(stop, s + slen - stop, t)
                break

    def consistent(self) -> bool:
        return len(self._starts) == len(self._ranges) and self.total == sum(n for n, _ in self._ranges.values())

    def within(self, ranges: list[tuple[int, int]]) -> _RangeSet:
        """A new set: the parts of these ranges inside ``ranges`` (sorted, disjoint); tolerates a
        torn set (its dict is read, not its list)."""
        out = _RangeSet()
        for s, (n, t) in sorted(self._ranges.items()):
            for fs, fn in ranges:
                lo, hi = max(s, fs), min(s + n, fs + fn)
                if lo < hi:
                    out.add(lo, hi - lo, t)
        return out

    def oldest(self, now: float) -> float:
        return max(now - t for _, t in self._ranges.values())

    def take(self, freed_before: float, max_bytes: int | None) -> list[tuple[int, int]]:
        out, got = [], 0
        for s in list(self._starts):
            length, t = self._ranges[s]
            if t <= freed_before:
                if max_bytes is not None and out and got + length > max_bytes:
                    break
                self._pop(s)
                out.append((s, length))
                got += length
        return out
