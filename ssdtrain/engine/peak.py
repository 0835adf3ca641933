"""What a step's forward may write: only what the drive finishes before the step's peak.

Plain objects, with no threads and no I/O: the engine feeds them times and byte counts under its
lock, and their tests drive them with made-up clocks and numbers.
"""

from __future__ import annotations

from collections import deque

__all__ = ["DriveMeter", "PeakClock", "possible_bytes", "LATE", "IN_TIME", "EARLY"]

# Note [write what leaves before the peak]
# A step's saved bytes peak where its forward ends (with checkpointing too: backward's start,
# when every checkpoint is held, is the same moment), and a save lowers that peak only if it is
# on the drive, and dropped from memory, by then. A write that completes later frees nothing that
# matters: it costs drive time, wear and, in backward, a read (or it is handed back from memory
# anyway). In the drive-limited regime (every GPU with an NVMe drive; a 2-core VM with a drive
# capped at 100 MB/s) the drive takes a few percent of what forward saves, and entries are large
# against it (a 32 MiB MLP activation takes a third of a second at 100 MB/s): measured on the
# bench model at 100 MB/s, two such writes still in flight when forward ended held 64 MiB that
# the drive had mostly moved, and the peak fell by 69-78% of what the drive could take before it.
# The peak is the most saved bytes held at once, reached at forward's last large save (saves only
# add to what is held, writes only take away): with a chunked loss, which computes for a tenth of
# forward and saves nothing large, a write that ends during the loss lowers no peak either.
# So a step's save is written only if the drive is predicted to finish it before that save:
# * the drive's rate is measured while it writes (``DriveMeter``: bytes over busy time), and so is
#   when it will be done with the writes in flight (``free_at``);
# * forward's time left is predicted from where this forward is (saves so far: Note [a forward of
#   another length]): the seconds the median of the last ``HISTORY`` forwards took from the same
#   save to its end (not the last: one slow or fast forward moves it only so far), at this
#   forward's pace so far;
# * at pack, a save is admitted (queued) if the drive, after the writes in flight and those queued,
#   finishes it within the time left; when the writer is about to start a queued write of this
#   forward it checks again with what it knows then, and a write that would end after the peak
#   is not started (its save stays in memory). A save refused does not close the forward: a
#   later, smaller one may still fit the time left;
# * a slow drive is handed one entry's worth at a time (``WriteQueue``): two entries written side
#   by side share it, and both finish late.
# Micro-batches (``off.microbatch``: pipeline stages) are exempt: a stage's peak comes several
# forwards later, and writes that end during them still lower it. ``late_writes=True`` turns the
# rule off for steps too (a step whose memory peaks in backward, say).
ADMIT_MARGIN = 1.0
"""A save is admitted (queued) if the drive is predicted to finish it, after the bytes already
queued, this many times over within the time left (an admitted write may still not start)."""
START_MARGIN = 1.05
"""A queued write starts only if the drive, after the writes in flight, is predicted to finish
it this many times over within the time left; else it stays in memory."""
PACE_LIMIT = 1.5
"""This forward's pace against the reference's counts for at most this factor either way (times the
ratio of their sizes: Note [a forward of another length])."""
HISTORY = 4
"""Forwards the prediction's curve is chosen from (the median one; the lower of two)."""
MIN_SAMPLE_BYTES = 4 << 20
"""The drive's rate is measured once it has written at least this much."""
LATE, IN_TIME, EARLY = 0, 1, 2
"""What :meth:`PeakClock.admits` predicts of a write at pack."""
LARGE_SAVE = 1 << 20
"""Where the peak is: the last save of at least this many bytes (or of 1/200 of a forward's)."""


class DriveMeter:
    """The drive's write rate: bytes written over the time it was busy writing (at least one
    write in flight), so that a drive idle between writes is not taken for a slow one; and when
    the drive is predicted to be done with the writes in flight (``free_at``)."""

    def __init__(self) -> None:
        self.rate: float | None = None
        self.free_at = 0.0
        self._inflight = 0
        self._since = 0.0
        self._bytes = 0
        self._seconds = 0.0

    def started(self, nbytes: int, now: float) -> None:
        """A write of ``nbytes`` went to the drive."""
        if self._inflight == 0:
            self._since = now
        self._inflight += 1
        if self.rate:
            self.free_at = max(self.free_at, now) + nbytes / self.rate

    def finished(self, nbytes: int, now: float) -> None:
        """A write of ``nbytes`` finished (or failed: ``nbytes`` 0)."""
        self._inflight = max(0, self._inflight - 1)
        self._bytes += nbytes
        if self._inflight == 0:
            self._seconds += max(0.0, now - self._since)
            self.free_at = now

    def recount(self, inflight: int, now: float) -> None:
        """The writes in flight, counted again (after an interrupt cut a start or a finish short)."""
        if inflight and not self._inflight:
            self._since = now
        elif self._inflight and not inflight:
            self._seconds += max(0.0, now - self._since)
            self.free_at = now
        self._inflight = inflight

    def sample(self, now: float) -> float | None:
        """Takes the rate measured since the last sample (when enough was written): half the new
        measure and half the old, so one odd forward moves it only so far."""
        seconds = self._seconds + (now - self._since if self._inflight else 0.0)
        if self._bytes < MIN_SAMPLE_BYTES or seconds <= 0:
            return self.rate
        measured = self._bytes / seconds
        self.rate = measured if self.rate is None else 0.5 * (self.rate + measured)
        self._bytes, self._seconds = 0, 0.0
        if self._inflight:
            self._since = now
        return self.rate


# Note [a forward of another length]: a forward is placed on the reference by its count of saves,
# not its bytes saved: the n-th save of the same model is at the same place in it whatever the
# sequence length, while the bytes at a place grow with the length. Placed by bytes (until
# 2026-11-28), a forward longer than the reference was past the reference's end half way through
# (twice the length) and had "no time left": every later save was kept. Measured: a 4096-token
# forward after a 64-token one kept all 35 MiB of its checkpoints, and fine-tuning with batches of
# varying length (dynamic padding) loses the offload in exactly its longest steps. The pace then
# scales the reference's time. The ratio of this forward's bytes so far to the reference's at the
# same save is the ratio of their lengths (or batches): it is the pace until a tenth of the forward
# is behind, and then widens the pace's limit (noise) by as much (a forward twice as long is paced
# up to 2 x PACE_LIMIT; its time grows by 2 to 4 with attention's square). On the test drive
# (tests/test_peak.py), a step of two and of three times the length after shorter ones wrote 20%
# of what the drive could take before its peak placed by bytes, and as much as steps of one length
# (84%) placed by saves. A forward with more saves than the reference (another model, a
# data-dependent branch) has no time left past its last, as before.
class PeakClock:
    """Whether a write is predicted to finish before this forward ends (see the Note).

    ``begin`` at a step's forward start, ``produced`` at each save (its bytes, offloaded or not),
    ``fits`` for each save considered (at pack), ``may_start`` for each queued write about to go
    to the drive (on any thread), ``end`` when backward begins.
    """

    def __init__(self, meter: DriveMeter) -> None:
        self.meter = meter
        self.active = False
        self.enforce = True  # the rule applies (``late_writes`` off); else only measured
        self.scope = None  # the step whose forward runs
        self.start = 0.0
        self.pos = 0
        self._positions: list[int] = []
        self._times: list[float] = []
        self._recent: deque[tuple[float, list[int], list[float]]] = deque(maxlen=HISTORY)
        self._ref: tuple[float, list[int], list[float]] | None = None
        self.last_seconds: float | None = None  # the last forward's

    def begin(self, scope: object, now: float) -> None:
        """``scope``'s forward (a step's) begins."""
        self.meter.sample(now)
        self.active, self.scope = True, scope
        self.start, self.pos = now, 0
        self._positions, self._times = [], []

    def produced(self, nbytes: int, now: float) -> None:
        if self.active:
            self.pos += nbytes
            self._positions.append(self.pos)
            self._times.append(now - self.start)

    def remaining(self, now: float) -> float | None:
        """Seconds from ``now`` to this forward's peak (its last large save): from its last save
        on, the time the reference forward took from the same save (Note [a forward of another
        length]), at this forward's pace so far (once a tenth of it is behind: a machine slower or
        faster for a while is so for the rest of the forward too), less the time since that save;
        ``None`` while none is known. Past the reference's last save: 0."""
        ref = self._ref
        if ref is None:
            return None
        until, positions, times = ref
        n = len(self._positions)
        if n > len(positions):
            return 0.0
        at = self._times[-1] if n else 0.0  # this forward's time at its position
        t = times[n - 1] if n else 0.0  # the reference's at the same save
        # the saved bytes so far against the reference's at the same save: its length against the
        # reference's, the pace until a tenth of the forward is behind, and the pace's limits after
        size = self.pos / positions[n - 1] if n and positions[n - 1] > 0 else 1.0
        pace = size
        if t > 0.1 * until:
            pace = min(PACE_LIMIT * max(1.0, size), max(min(1.0, size) / PACE_LIMIT, at / t))
        return max(0.0, (until - t) * pace - (now - self.start - at))

    def _in_time(self, nbytes: int, margin: float, now: float) -> bool:
        rate = self.meter.rate
        if not self.active or not self.enforce or not rate:
            return True
        left = self.remaining(now)
        return left is None or (max(0.0, self.meter.free_at - now) + nbytes / rate) * margin <= left

    def fits(self, nbytes: int, queued: int, now: float) -> bool:
        """At pack: whether a write of ``nbytes``, queued behind ``queued`` bytes not started yet
        and the writes in flight, is predicted done before forward ends (``True`` while the rate
        or the forward's length is unknown): :meth:`admits` not ``LATE``."""
        return not self.enforce or self.admits(nbytes, queued, now) != LATE

    def may_start(self, scope: object, nbytes: int, now: float) -> bool:
        """Whether a queued write of ``nbytes`` of ``scope`` may go to the drive now, after the
        writes in flight: not if it is this forward's and would end after it."""
        return scope is not self.scope or self._in_time(nbytes, START_MARGIN, now)

    # Note [a save well before the peak goes at once]
    # The last save waits (Note [the last save waits], ``writer.py``) because it may be forward's last, which
    # backward needs first. A drive's write that the peak clock (Note [write what leaves before the
    # peak]) knows will end before its forward's peak (the drive's rate and the
    # forward's length known, the writes queued ahead of it counted) is not that save: forward goes
    # on for at least as long. Held, it waited for the next save, which with checkpointed blocks is
    # the next block's input, a whole block later: on the bench decoder under a 25 MB/s drive
    # (issue 64, item 4) block 0's input (8.4 MB, 0.34 s to write) started at block 1's, 0.19 s
    # into a 1.49 s forward, and only three of the four writes the drive had time for ended before
    # the peak. Such a save is queued at once (and the one held before it); it still goes only
    # once its op returned, unless an earlier op made its bytes (Note [bytes an earlier op made may
    # go at once] in ``writer.py``).
    def admits(self, nbytes: int, queued: int, now: float) -> int:
        """At pack, for a write of ``nbytes`` queued behind ``queued`` bytes not started yet and the
        writes in flight: ``LATE`` if it is predicted to end after this forward's peak (``fits``
        false); ``EARLY`` if it is known to end before it, with ``START_MARGIN`` to spare (the
        drive's rate and the forward's length known: Note [a save well before the peak goes at
        once] in ``writer.py``); else ``IN_TIME`` (also while either is unknown). One prediction
        for both questions."""
        rate = self.meter.rate
        if not self.active or not rate:
            return IN_TIME
        left = self.remaining(now)
        if left is None:
            return IN_TIME
        need = max(0.0, self.meter.free_at - now) + (queued + nbytes) / rate
        if need * START_MARGIN <= left:
            return EARLY
        return IN_TIME if not self.enforce or need * ADMIT_MARGIN <= left else LATE

    def end(self, now: float) -> float | None:
        """The forward ended (backward begins); returns the seconds from its start to its peak
        (its last large save; its end if it saved nothing)."""
        if not self.active:
            return None
        self.active, self.scope = False, None
        seconds = now - self.start
        if self._positions and seconds > 0:
            seconds = _peak_time(self._positions, self._times)
            self._recent.append((seconds, self._positions, self._times))
            self._ref = sorted(self._recent, key=lambda r: r[0])[(len(self._recent) - 1) // 2]
        self.last_seconds = seconds
        return seconds


def _peak_time(positions: list[int], times: list[float]) -> float:
    """When a forward's last large save was made (seconds from its start)."""
    large = max(LARGE_SAVE, positions[-1] // 200)
    for i in range(len(positions) - 1, -1, -1):
        if positions[i] - (positions[i - 1] if i else 0) >= large:
            return times[i]
    return times[-1]


def possible_bytes(rate: float | None, seconds: float | None, unique: int) -> int | None:
    """What the drive could take before the peak: ``min(rate x seconds to the peak, saved bytes)``."""
    if not rate or seconds is None:
        return None
    return int(min(rate * seconds, unique))
