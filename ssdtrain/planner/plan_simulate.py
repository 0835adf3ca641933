"""The offloader's rules played on one micro-batch's saves (``plan_saves.py``), for ``ssdtrain plan``'s
drive-limited model (``plan_drive.py``): what the host tier copies, what the drive writes and reads
back in time, what the step frees before its peak and what it keeps, with the same rules the
offloader follows (``ssdtrain/engine/offloader.py``, ``writer.py``, ``schedule.py``):

* **Writes** (Note [the last save waits]): each save of ``min_bytes`` or more is held until the
  next one of at least a quarter of its size comes (a smaller one is queued at once instead),
  and the one still held at the end is never written; the pack that queues a save hands it over
  at once if it may (so the last save still sends the one before it). Queued saves go to the
  drive in pack order, at most ``handoff_bytes`` handed over at once (one more when none is in
  flight); the drive writes them one after another at ``B_write``. Note [write what leaves before the peak] (``peak.py``): a
  write that would end after forward ends is not made (its save stays in memory; a later,
  smaller one may still fit); what was written frees its memory before the peak, which falls by
  that much (``free_bytes``), of at most ``min(B_write * T_forward, saved)`` (``possible_bytes``).
  When backward begins, what is still queued is cancelled and kept (adaptive keep).
* **Reads**: what was written before backward began is read back in reverse pack order from
  the moment backward begins, at ``B_read``, one after another (the read-ahead window is assumed
  never to hold them back: the room backward frees is theirs). A read that ends after its save
  is needed makes backward wait. Note [write only what comes back in time]: when backward would
  wait longer than ``max(10 ms, 1% of the step)``, the write budget lets only the earliest saves
  go (backward needs them last) - the longest prefix whose reads all come in time.
* Writes and reads are separate directions of the drive (as the bench's throttles model them).
* **The host tier** (``--host-gbps``, ``--host-gib``; Note [copy what leaves before the peak] in
  ``copy_clock.py``): in front of the drive, queued saves are copied to pinned host memory one after
  another at ``B_host``, each no sooner than it is queued; a copy that would end after forward
  ends is not made, and the rest of that forward stays in memory (the copy clock closes); a save
  the tier has no room for (``host_gib``, shared by the micro-batches in flight) goes to the
  drive, under the drive's rules. What was copied is freed before the peak and read back at
  ``B_host`` from backward's start (no read budget: the tier has none).
* **1F1B** (``stages > 1``; the first stage, in steady state): a micro-batch's backward comes
  ``stages - 1`` slots after its forward, each slot one forward and one backward. The drive
  writes for every micro-batch in flight, so each gets one slot's share of it: its writes run
  from its packs to ``T_forward + T_backward`` after its forward began, and what is not written
  by then is kept (no tail: a write past its share takes the next micro-batch's). Its reads
  start a slot early (``Offloader.prefetch`` before the forward that precedes its backward, as
  the Megatron integration does), ``T_forward`` before its backward. What one micro-batch can
  carry is then about ``min(B_write, B_read) (T_forward + T_backward)``, against the single
  step's ``min(B_write T_forward, B_read T_backward)``. Measured (``benchmarks/pipeline_stage.py``,
  4 stages, 80 ms forward, 150 ms backward, ``benchmarks/RESULTS.md`` 2026-11-24 19:50): the
  engine wrote 11.7, 28.8 and 73 MiB per micro-batch at 50, 200 and 1000 MB/s, this model
  8, 44 and 66 MiB (the engine's budget settles below the slot's capacity at 200 MB/s), the
  single-step model 2, 12 and 65.

Not modelled: a real drive serves the I/O threads' requests side by side, so a save may be done
later than in the order above (``benchmarks/RESULTS.md``, 2026-11-24, has the measured effect);
under 1F1B, the read-ahead window may hold reads back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ssdtrain.planner.plan_saves import Save

__all__ = ["DRIVE_BOUND", "MIN_DRIVE_STALL", "DriveStep", "simulate"]

# Note [write only what comes back in time] (schedule.py): read waits under these are a read's
# latency, not a drive too slow, and do not shrink the write budget.
DRIVE_BOUND = 0.01
MIN_DRIVE_STALL = 0.010


@dataclass(frozen=True)
class DriveStep:
    """What the drive does with one micro-batch's saves (bytes per micro-batch)."""

    saved_bytes: int
    """Every save (what baseline keeps)."""
    eligible_bytes: int
    """Saves of ``min_bytes`` or more, less the one held at the end (never written)."""
    capacity_bytes: float
    """``min(B_write * T_forward, B_read * T_backward)``: what the drive could carry (under 1F1B,
    ``min(B_write, B_read) * (T_forward + T_backward)``)."""
    possible_bytes: float
    """``min(B_write * T_forward, saved)``: the most the peak could fall by (under 1F1B, with the
    slot in place of the forward)."""
    free_bytes: int
    """Written during forward and read back in time: the memory offloading frees, at no cost,
    before the peak: the peak's fall."""
    tail_bytes: int
    """Handed to the drive and not written when backward began: written, but not freed (none in
    a step: such writes are not made; under 1F1B, none either)."""
    written_bytes: int
    """``free_bytes + tail_bytes``: what the step writes."""
    kept_bytes: int
    """Everything else stays in memory (``saved_bytes - free_bytes``)."""
    read_wait_s: float
    """What backward would wait on reads if all the written saves were read back."""
    budget_bound: bool
    """Whether the write budget had to hold saves back (reads would not come in time)."""
    forward_s: float
    backward_s: float
    host_bytes: int = 0
    """Copied to the host tier before forward ended: freed (part of ``free_bytes``)."""
    spilled_bytes: int = 0
    """Saves the host tier had no room for, handed to the drive."""


def _queue(saves_: list[Save], eligible: list[int]) -> list[tuple[int, float]]:
    """The saves queued for writing, in queue order, with the time each is queued: a save is held
    until the next one of at least a quarter of its size (``WriteQueue.hold``); a smaller one is
    queued at once; the one held at the end is not queued."""
    queue: list[tuple[int, float]] = []
    held = None
    for i in eligible:
        if held is not None and 4 * saves_[i].nbytes < saves_[held].nbytes:
            queue.append((i, saves_[i].packed_s))
            continue
        if held is not None:
            queue.append((held, saves_[i].packed_s))
        held = i
    return queue


def _write(saves_: list[Save], queue: list[tuple[int, float]], forward_s: float, bps: float,
           handoff: int, deadline: float | None = None) -> list[float | None]:
    """Completion time of each queued write (None: still queued when backward began, or not made
    because it would end after ``deadline``)."""
    order = [i for i, _ in queue]
    done: list[float | None] = [None] * len(order)
    end = 0.0          # when the drive finishes what it was handed
    flight: list[tuple[float, int]] = []  # (end, bytes) of the writes handed over, oldest first
    inflight = 0
    for k, i in enumerate(order):
        # Handed over once the writes in flight are under ``handoff`` bytes (or none is left).
        t = queue[k][1]
        while flight and inflight >= handoff:
            t = max(t, flight[0][0])
            inflight -= flight.pop(0)[1]
        while flight and flight[0][0] <= t:
            inflight -= flight.pop(0)[1]
        if t > forward_s:
            break  # backward began: the rest is cancelled (a save's pack hands over before it ends)
        finish = max(end, t) + saves_[i].nbytes / bps
        if deadline is not None and finish > deadline:
            done[k] = math.inf  # not made: it would end after the peak; its save stays in memory
            continue
        end = done[k] = finish
        flight.append((finish, saves_[i].nbytes))
        inflight += saves_[i].nbytes
    return done


def _copy(saves_: list[Save], queue: list[tuple[int, float]], forward_s: float, bps: float,
          capacity: float) -> tuple[list[int], list[tuple[int, float]]]:
    """The host tier's share of ``queue`` (the module docstring's "host tier"): the saves copied
    before forward ends, and the queue of those it had no room for (the drive's)."""
    copied: list[int] = []
    spill: list[tuple[int, float]] = []
    end, used = 0.0, 0
    for i, t in queue:
        n = saves_[i].nbytes
        finish = max(end, t) + n / bps
        if t > forward_s or finish > forward_s:
            break  # due after forward's end: not copied, and the rest of forward is kept
        if used + n > capacity:
            spill.append((i, t))
            continue
        end, used = finish, used + n
        copied.append(i)
    return copied, spill


def _read_wait(saves_: list[Save], idx: list[int], bps: float, lead_s: float = 0.0) -> float:
    """Backward's wait if ``idx`` (pack order) are read back in reverse from ``lead_s`` before
    backward's start."""
    wait, t = 0.0, -lead_s
    for i in reversed(idx):
        t += saves_[i].nbytes / bps
        wait = max(wait, t - saves_[i].needed_s)
    return wait


def simulate(saves_: list[Save], *, forward_s: float, backward_s: float, write_bps: float, read_bps: float,
             handoff_bytes: int, min_bytes: int, pipelined: bool = False, host_bps: float = 0.0,
             host_capacity: float = 0) -> DriveStep:
    """What the offloader writes, frees and keeps of one micro-batch's ``saves_`` on a drive of
    ``write_bps`` / ``read_bps`` bytes per second (the rules in the module docstring), behind a
    host tier of ``host_bps`` and ``host_capacity`` bytes (0: none).

    ``pipelined``: the micro-batch is one of a 1F1B stage's in steady state, with others' slots
    between its forward and its backward (the module docstring's "1F1B")."""
    if not (write_bps > 0 and read_bps > 0 and handoff_bytes > 0 and min_bytes >= 0 and host_bps >= 0
            and host_capacity >= 0):
        raise ValueError(f"drive rates and handoff_bytes must be > 0, min_bytes and the host tier's figures >= 0, got "
                         f"write_bps={write_bps!r}, read_bps={read_bps!r}, handoff_bytes={handoff_bytes!r}, "
                         f"min_bytes={min_bytes!r}, host_bps={host_bps!r}, host_capacity={host_capacity!r}")
    eligible = [i for i, s in enumerate(saves_) if s.nbytes and s.nbytes >= min_bytes]
    queue = _queue(saves_, eligible)
    eligible_bytes = sum(saves_[i].nbytes for i, _ in queue)
    copied: list[int] = []
    tier = host_bps > 0 and host_capacity > 0
    if tier:
        copied, queue = _copy(saves_, queue, forward_s, host_bps, host_capacity)
    order = [i for i, _ in queue]
    total = sum(s.nbytes for s in saves_)
    # The writes' time: until backward begins; in a pipeline, one slot's share of the drive.
    until = forward_s + backward_s if pipelined else forward_s
    lead = forward_s if pipelined else 0.0  # reads start a slot early, as another forward runs
    done = _write(saves_, queue, until, write_bps, handoff_bytes, None if pipelined else forward_s)
    freed = [i for i, t in zip(order, done) if t is not None and t <= until]
    # A pipeline's micro-batch has no tail: a write past its slot's share takes the next one's.
    tail = 0 if pipelined else sum(saves_[i].nbytes for i, t in zip(order, done)
                                   if t is not None and until < t < math.inf)
    wait = _read_wait(saves_, freed, read_bps, lead)
    bound = False
    tolerance = max(MIN_DRIVE_STALL, DRIVE_BOUND * (forward_s + backward_s))
    if wait > tolerance:
        # The budget: the earliest saves, as many as come back in time; nothing else is queued.
        bound, tail = True, 0
        while freed and _read_wait(saves_, freed, read_bps, lead) > tolerance:
            freed.pop()
    host = sum(saves_[i].nbytes for i in copied)
    if copied:
        wait = max(wait, _read_wait(saves_, copied, host_bps, lead))
    written = sum(saves_[i].nbytes for i in freed)
    free = written + host
    host_possible = min(host_bps * forward_s, host_capacity) if tier else 0.0
    return DriveStep(
        saved_bytes=total, eligible_bytes=eligible_bytes,
        capacity_bytes=min(write_bps * until, read_bps * (backward_s + lead)),
        possible_bytes=min(write_bps * until + host_possible, total), free_bytes=free, tail_bytes=tail,
        written_bytes=written + tail, kept_bytes=total - free, read_wait_s=wait, budget_bound=bound,
        forward_s=forward_s, backward_s=backward_s, host_bytes=host, spilled_bytes=sum(saves_[i].nbytes for i in order),
    )
