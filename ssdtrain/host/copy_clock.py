"""What each forward may copy to the host tier before its peak, and when each copy is due.

The :class:`CopyClock` is arithmetic on bytes and seconds, with no device: the engine tells it
each save's size and each forward's device time, and asks it whether a save may be copied and at
which forward position that copy is done. Its rules are the two notes below.
"""

from __future__ import annotations

__all__ = ["CHEAP_SHARE", "COPY_SHARE", "DUE_MARGIN", "HOST_STRETCH", "PROBE_SHARE", "CopyClock"]

COPY_SHARE = 0.9
"""Of what the copy engine can move during a forward, what a forward is given (Note [copy what
leaves before the peak])."""
DUE_MARGIN = 1.1
"""A copy is due when forward has produced this much more than the copy's predicted finish."""
HOST_STRETCH = 0.05
"""How much longer than its reference the host may take over a forward for its copies (Note [the
host paces the copies])."""
PROBE_SHARE = 0.02
"""Of the copy engine's budget, what a forward paced to no copies still copies, to measure again."""
CHEAP_SHARE = 0.25
"""A forward that copied every save it offered, in at most this share of its device time, is its
own reference (Note [a forward whose copies are cheap is its own reference])."""


# Note [copy what leaves before the peak]
# The step's peak is at the end of forward (with checkpointing, at backward's start), and a copy
# lowers it only if the save leaves device memory before then. Forward on an H100 makes 200-330
# GB/s of activations against 53 GB/s of copy to the host, so each forward is given what the copy
# engine moves in the last forward's device time (``COPY_SHARE`` of ``rate x seconds``), to the
# earliest saves (backward needs them last); the rest stays on the device, uncopied. Each copy is
# *due* at the forward position (bytes produced so far: the clock of the device's progress that
# the host can see) where it is predicted done: copies run one after another in pack order, each
# no sooner than its save was produced, so with ``ratio`` = production rate / copy rate a copy of
# ``n`` bytes finishes at ``max(previous finish, its save's position) + n x ratio``. A copy is
# released (stream-ordered) once due, or once the device says it is done. Both rates are measured:
# the copy rate once per device, forward's time and production rate on a forward that copies
# nothing (the first once the copy rate is known: its saves stay on the device), since a forward's
# own copies lengthen it (``CopyClock.learn``).
#
# Note [the reference forward needs room]: that forward keeps on the device what the tier would
# have taken, so its peak is the step's peak without the tier. Where the last step's peak plus
# those bytes does not fit in the device's memory (a user at the longest sequence that trains only
# with offloading), it would run out of memory: there the measurement waits, and forwards copy
# every save due before forward's end, by due positions from the last forward (longer for its
# copies: a ratio too low, due too early, so the compute stream may wait for a copy: slower, but
# alive). Seen on an H200 (2026-11-27): at recompute+offload's longest sequence under a 6 GiB cap,
# the step measured kept every block input on the device. The room asked for is ``REFERENCE_ROOM``
# times what the clock let leave in the last forward (``sent``: to the tier, or to the drive where
# the pool had no room) plus ``REFERENCE_SLACK`` for the caching allocator's fragmentation: on the
# same H200 and cap (a later call), recompute+offload ran out of memory at 40960 tokens, where
# recompute trains, asking 512 MiB with 169-228 MiB of the cap reserved but unallocated. Which of
# its steps did is not known (no GPU since): this margin is a guess at the cause, not a proof.

# Note [a copy is due from its hand-over]
# A copy's due position is set when the write queue hands it to the copy thread, from the forward
# position then, not when its save was packed: a tier save is held until the next save comes (Note
# [the last save waits]) and handed over a batch at a time (Note [tier copies are handed over a
# batch at a time]), so under checkpointing a block input's copy is queued a block after its pack.
# Due from its pack, it was due as soon as it was queued: released at once, the compute stream
# waited for the whole copy at every block. On an H200 (2026-11-27, the bench's GPU shape, 12
# block inputs of 32 MiB) that made recompute+offload x1.205 of recompute, its device forward 37.7
# ms against 25.8, and the host's pacing (Note [the host paces the copies]) cut the copies to a
# third of the block inputs to get back to x1.07. ``allows`` counts the bytes allowed and not yet
# handed over (``pending``) as queued ahead of a new copy, so a copy due after forward's end is
# still refused.

# Note [a first step's copies are due at once]: before the rates are known (the first steps, and
# those whose reference forward waits for room), a copy is due as soon as it is queued: it is
# released, in stream order, at the next look, and the compute stream waits for it from there.
# Due "once seen done" instead, a GPU-bound forward, whose host runs ahead of the device, saw no
# copy done before its peak and freed nothing: the first step's peak was the peak without the
# tier (a GPU test of a fresh Offloader, H200 2026-11-27), and at a length that trains only with
# the tier the first steps ran out of memory (recompute+offload at 49152 and 65536 tokens under a
# 6 GiB cap, in the second step). Waiting for copies makes those steps slower, never larger.

# Note [the host paces the copies]
# The copy engine's budget counts device time; each copy also costs the training thread (its
# save's entry, the copy's queueing: 30-200 us a copy on an H200's host, 2026-11-27), and where
# the host sets forward's pace that cost lengthens the step: a slower H200 host ran `offload` at
# x1.24-1.38 of baseline, copying 134% of what the engine could move before the peak. So the
# forward copying nothing also gives the host's time (its saves all kept: the hooks' own cost
# counted), and after each forward that copied, the bytes the next may copy are scaled by how far
# the host's time went past, or stayed under, ``HOST_STRETCH`` over the longer of that forward's
# device and host times (the host's time taken as linear in the copies; growth at most x1.25 a
# forward; never under ``PROBE_SHARE`` of the engine's budget, so the cost is measured again).
# A host far ahead of its device (GPU-bound) leaves the engine's budget as it is. A forward whose
# copies were cheap enough to be its own reference has no host time without copies, and is not
# paced: its copies are few. A copy costs the host the same at any length, and the host's time
# without copies is the reference's at any length (the same saves and kernels): so what the host
# allows is kept as seconds per byte copied at the reference's length, and a longer forward, with
# more device time to hide its copies in, may copy more (its growth's x1.25 is scaled by its room).

# Note [a forward whose copies are cheap is its own reference]
# The forward measured copying nothing exists to learn forward's time free of its copies' cost,
# for a budget that would otherwise grow with it. Where a forward copied every save it offered
# (no limit refused one; a last save whose copy would end after forward's end may stay) and the
# copy engine needed at most ``CHEAP_SHARE`` of its device time
# for them, that budget cannot grow past what is copied already, and copying made the forward no
# longer than a quarter: it is taken as the reference, and no forward keeps everything on the
# device. That is recompute+offload's case (a few large block inputs, about 60 ms of copies in a
# 500 ms forward at 65536 tokens on an H200), where a forward copying nothing holds recompute's
# peak, at a length that only trains with the tier: it ran out of memory there (2026-11-27).
# Note [a copy clock for forwards of any length]
# Fine-tuning pads each batch to its longest (Hugging Face's collators, group_by_length, packed
# batches of varying totals), so forwards of one model come in many lengths. The clock learns a
# reference from one forward (its device seconds, its bytes, its position after each save) and
# places every other forward on it by its count of saves, as the drive's rule does (Note [a
# forward of another length] in ``engine/peak.py``): the n-th save of the same model is at the
# same place in it at any length, and the bytes so far over the reference's at the same save is
# this forward's length over the reference's (``size``). The reference's budget and its end (the
# peak, in positions) are scaled by it; the ratio of production to copy rate does not change (the
# device's time is taken as linear in the length, so a longer forward, whose attention makes it
# longer still, is given a little less than it could copy: never more). A forward replaces the
# reference when it is faster for its length. Placed by bytes (until 2026-11-28), a forward past
# the reference's bytes had its every copy due after its end: on the modelled H100 of
# ``benchmarks/copy_clock_lengths.py`` (Llama-3.1-8B-shaped recompute+offload), a 16k-token step
# after four of 1k copied 3% of what the copy engine could take before its peak, an 8k step 9%,
# and a 1k or 2k step after long ones 42-48%; placed by saves, 94% each. The host's pace is
# length-free (Note [the host paces the copies]). Every save is counted, small ones and saves of
# a storage saved before too (Note [the copy clock counts every save], below).


class CopyClock:
    """Positions in a forward, in bytes produced (see the Note); what a forward may copy."""

    def __init__(self) -> None:
        self.rate: float | None = None   # device-to-host bytes per second
        self.ratio: float | None = None  # production rate / copy rate, from the last forward
        self.limit: int | None = None    # bytes a forward may copy; None: not learned yet
        self.pos = 0
        self.saves = 0  # this forward's saves so far (Note [a copy clock for forwards of any length])
        self._positions: list[int] = []  # this forward's position after each of its saves
        self._ref_positions: list[int] = []  # the reference forward's
        self.tail = 0.0
        self.pending = 0  # bytes allowed and not handed to the copy thread yet (Note [a copy is due from its hand-over])
        self.sent = 0
        self.closed = False  # this forward was refused a copy: the rest of it is kept
        self.limited = False  # ... by the limit (not for a copy due after forward's end)
        self.reference: float | None = None  # device seconds of a forward that copied nothing
        self.total = 0  # bytes that forward produced: where its peak is, in its positions
        self.deferred = 0  # forwards not measured for want of room (Note [the reference forward needs room])
        self.timed = False  # a forward was timed with the copy rate known (learn was told its seconds)
        self.host_reference: float | None = None  # host seconds of the forward that copied nothing
        # Note [the host paces the copies], in bytes at the reference's length: the host's seconds
        # per byte copied (None: not measured), what it may grow to, and what it keeps
        self.host_cost: float | None = None
        self.host_grow = 0.0
        self.host_floor = 0.0
        self.host_room = 0.0

    def wants_reference(self) -> bool:
        """Whether the next forward is to be measured, copying nothing: once the copy rate is
        known and a forward that copied was timed (it may be the reference itself: Note [a forward
        whose copies are cheap is its own reference])."""
        return self.reference is None and self.rate is not None and self.timed

    def begin(self, room: bool = True) -> None:
        """A forward begins; with the copy rate known and no reference yet, it copies nothing
        (it is measured for the reference), unless the device has no ``room`` for what the last
        forward copied: then it copies as before the rate was known."""
        last = self.sent
        self.pos, self.tail, self.pending, self.sent, self.closed, self.limited = 0, 0.0, 0, 0, False, False
        self.saves, self._positions = 0, []
        if self.wants_reference():
            if room or not last:
                self.limit = 0
            else:
                self.limit = None
                self.deferred += 1

    # Note [the copy clock counts every save]
    # The copy clock's positions are the bytes a forward produced, and the forward measured for
    # its reference copies nothing: its budget closes at the first save, and every later save is
    # kept at once, with no entry. Those saves are counted too; counting entries alone gave that
    # forward a total of one save, and every copy after was refused as due after forward's end
    # (the H200, 2026-11-27: the tier copied nothing, offload lowered no peak). Small saves and
    # saves of a storage saved before are counted as well (the latter with no bytes): the clock
    # places a forward on its reference by its count of saves (Note [a copy clock for forwards of
    # any length]), and a storage small at one length (the rotary tables at 1k tokens) is an
    # entry at another.
    def produced(self, nbytes: int) -> None:
        """A save of ``nbytes`` new bytes was made (offloaded or not, small or not; 0 for a save
        of a storage saved before): every save is counted (Note [a copy clock for forwards of any
        length])."""
        self.pos += nbytes
        self.saves += 1
        self._positions.append(self.pos)

    def size(self) -> float:
        """This forward's length against the reference's: its bytes so far over the reference's
        at the same save (1 before its first save or without a reference)."""
        ref, n = self._ref_positions, self.saves
        if not n or not ref:
            return 1.0
        at = ref[min(n, len(ref)) - 1]
        return self.pos / at if at > 0 else 1.0

    def allows(self, nbytes: int) -> bool:
        """Whether this forward may copy ``nbytes`` more (and counts them if so): within the
        limit, and due before forward's end (a copy done after the peak frees nothing that
        matters; its bytes would only come back again)."""
        size = self.size()
        if self.limit is not None and self.sent + nbytes > self._limit_at(size):
            self.closed = self.limited = True
            return False
        if self.ratio is not None and \
                max(self.tail, self.pos) + (self.pending + nbytes) * self.ratio * DUE_MARGIN > self.total * size:
            self.closed = True
            return False
        self.sent += nbytes
        self.pending += nbytes
        return True

    def dropped(self, nbytes: int) -> None:
        """A save of ``nbytes`` that :meth:`allows` let through is not copied after all (the pool
        had no room): no copy of it will be handed over."""
        self.pending = max(0, self.pending - nbytes)

    def schedule(self, nbytes: int) -> float:
        """The position at which a copy of ``nbytes`` handed to the copy thread now is due: at
        once while the rates are not known (Note [a first step's copies are due at once]); else
        after the copies handed over before it, and no sooner than from now (Note [a copy is due
        from its hand-over])."""
        self.pending = max(0, self.pending - nbytes)
        if self.ratio is None:
            return self.pos
        self.tail = max(self.tail, self.pos) + nbytes * self.ratio * DUE_MARGIN
        return self.tail

    def is_due(self, due: float) -> bool:
        return self.pos >= due

    def learn(self, seconds: float | None, produced: int, host: float | None = None) -> None:
        """A forward that produced ``produced`` bytes took ``seconds`` on the device (``host``: on
        the host, between the same two points).

        Only a forward that copied nothing is learned from (the first after the copy rate is
        known), and then one faster for its length (Note [a copy clock for forwards of any
        length]): a forward's own copies lengthen it (the host's work for each, a compute stream
        that waited), and learning from that would give the next forwards more to copy, so longer
        ones: on an H100 the limit grew to copying everything (2.5 GiB a step where 1.2 moved
        before the peak, and the step x2.1)."""
        if not seconds or seconds <= 0 or not self.rate or produced <= 0:
            return
        self.timed = True
        if self.reference is None and self.limit != 0 and not self.limited and \
                self.sent <= CHEAP_SHARE * self.rate * seconds:
            # Note [a forward whose copies are cheap is its own reference]
            self._take_reference(seconds, produced)
        if self.reference is None:
            if self.limit != 0:  # it copied: not a measure of forward alone
                if self.deferred and self.limit is None:
                    # Note [the reference forward needs room]: due positions from it meanwhile, so
                    # that copies are released in stream order (released once seen done, they free
                    # nothing before the peak when the host runs ahead of the device).
                    self.ratio, self.total = produced / seconds / self.rate, produced
                    self._ref_positions = self._positions
                return
            self._take_reference(seconds, produced)
            self.host_reference = host
        elif self.limit != 0 and self.host_reference is not None and host is not None:
            self._pace(host, produced)  # a forward that copied, after the reference: Note [the host paces the copies]
        if seconds * self.total <= self.reference * produced:  # faster for its length
            self._take_reference(seconds, produced)
        self.ratio = self.total / self.reference / self.rate
        self.limit = int(self.engine if self.host_cost is None else min(self.engine, self._host_allows(1.0)))

    @property
    def engine(self) -> float:
        """What the copy engine moves in the reference forward's time, ``COPY_SHARE`` of it (0
        before a reference)."""
        return COPY_SHARE * self.rate * self.reference if self.rate and self.reference else 0.0

    def _take_reference(self, seconds: float, produced: int) -> None:
        if self.total and self.host_cost is not None:  # the host's measures, at the new length
            f = produced / self.total
            self.host_cost, self.host_grow, self.host_floor = self.host_cost / f, self.host_grow * f, self.host_floor * f
        self.reference, self.total, self._ref_positions = seconds, produced, self._positions

    def _limit_at(self, size: float) -> float:
        """The bytes this forward may copy, at ``size`` times the reference's length."""
        if self.host_cost is None or not self.limit or not self.engine:
            return self.limit * size
        return min(self.engine, self._host_allows(size)) * size

    def _host_allows(self, size: float) -> float:
        """What the host's pace allows a forward ``size`` times the reference's length to copy, in
        bytes at the reference's length (Note [the host paces the copies])."""
        room = max(self.reference * size, self.host_reference) * (1 + HOST_STRETCH) - self.host_reference
        by_cost = room / self.host_cost if self.host_cost > 0 else float("inf")
        grow = self.host_grow * max(1.0, room / self.host_room) if self.host_room > 0 else self.host_grow
        return max(self.host_floor, min(grow, by_cost), PROBE_SHARE * self.engine)

    def _pace(self, host: float, produced: int) -> None:
        """Note [the host paces the copies]: the last forward (``produced`` bytes) copied ``sent``
        bytes in ``host`` seconds of the host's time: the host's seconds per byte copied (in
        bytes at the reference's length: a copy costs the host the same at any length), and what
        the next may copy to stay within ``HOST_STRETCH`` of the longer of the host's time without
        copies (the reference's: the same saves and kernels at any length) and its own device
        time (the reference's, scaled by its length)."""
        size = produced / self.total if self.total else 1.0
        sent = self.sent / size
        target = max(self.reference * size, self.host_reference) * (1 + HOST_STRETCH)
        over = host - self.host_reference
        allowed = self.engine if self.host_cost is None else min(self.engine, self._host_allows(size))
        self.host_cost = over / sent if over > 0 and sent > 0 else 0.0
        self.host_grow = 1.25 * sent  # the host's time taken as linear in the copies: checked again
        self.host_room = target - self.host_reference  # ... as far as a forward with more room allows
        self.host_floor = allowed if host <= target else 0.0
