"""Counters of an offloader, and the snapshot users read (:class:`OffloadStats`)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

__all__ = ["OffloadStats", "Counters"]


@dataclasses.dataclass
class OffloadStats:
    """A snapshot of what an :class:`~ssdtrain.Offloader` did since it was created.

    Bytes are payload bytes of saved activations (parameters and buffers never count).
    """

    backend: str = ""
    """Which backend ``auto`` chose, with its paths and whether O_DIRECT is on."""
    saved_bytes: int = 0
    """All activation bytes that reached pack, a repeated save counted each time."""
    unique_bytes: int = 0
    """Bytes of distinct storages among them (what dedup leaves)."""
    written_bytes: int = 0
    """Bytes written to storage: the drives and the host tier."""
    read_bytes: int = 0
    """Bytes read back from storage: the drives and the host tier."""
    kept_bytes: int = 0
    """Bytes never written: below ``min_bytes``, in the last ``keep_last_layers`` blocks, over the
    write budget, kept under backpressure (``when_full="keep"``) or after a failed write
    (``on_error="keep"``). Saves inside ``keep_modules`` never reach the offloader and are not
    counted, like parameters."""
    budget_kept_bytes: int = 0
    """Of those, bytes kept because the drive could not have carried them back in time (the
    write budget, learned from backward's waits)."""
    peak_kept_bytes: int = 0
    """Of those, bytes kept because their write would have ended after the step's peak (the end
    of its forward), where it frees nothing that matters."""
    peak_fall_bytes: int = 0
    """The last step's: what offloading took off its peak of saved bytes (reached in forward):
    the bytes its forward saved, less the most of them held in memory at once."""
    peak_bound_bytes: int | None = None
    """The last step's: what the drive could have taken before its peak, ``min(drive_write_bps x
    seconds from forward's start to its peak, unique bytes saved)``; ``None`` before the drive's
    rate is known. The peak is forward's last large save (saves add to what is held, writes take
    away): its end, unless forward computes on after it (a chunked loss)."""
    drive_write_bps: float | None = None
    """The drive's write rate as measured while it was writing (bytes per second)."""
    write_budget_bytes: int | None = None
    """Bytes a step may write now; ``None`` while no limit was needed."""
    forwarded_bytes: int = 0
    """Bytes handed back to backward from memory with no read (their write cancelled or done)."""
    adaptive_keep_bytes: int = 0
    """Of those, bytes whose write was still queued when backward began, and was cancelled."""
    cancelled_writes: int = 0
    peak_resident_bytes: int = 0
    """Peak bytes of saved activations held in memory by the offloader and autograd."""
    resident_bytes: int = 0
    """The same, now."""
    stall_seconds: float = 0.0
    """Time compute waited on I/O: reads not done when needed, plus backpressure waits."""
    read_stall_seconds: float = 0.0
    backpressure_stall_seconds: float = 0.0
    backpressure_waits: int = 0
    """Packs that waited because ``max_inflight_bytes`` were queued (``when_full="wait"``)."""
    backpressure_keeps: int = 0
    """Packs that kept their tensor in memory for the same reason (``when_full="keep"``)."""
    writes: int = 0
    reads: int = 0
    prefetch_hits: int = 0
    """Unpacks of offloaded tensors whose read had completed before they were needed."""
    prefetch_misses: int = 0
    """Unpacks that had to wait for (or issue) their read."""
    prefetch_window_bytes: int = 0
    """The read-ahead window now: starts at 16 MiB, doubles when backward waited on reads for more
    than 0.25% of a step, shrinks after a step with no wait; at most ``prefetch_bytes``. Reads
    also fill memory backward has freed (never above the saved bytes resident when it began)."""
    failed_writes: int = 0
    lost_bytes: int = 0
    """Drive space never reused because a KeyboardInterrupt came while its write was handed
    over (a late write could have landed on the next owner's bytes); given back at close()."""
    failed_reads: int = 0
    live_entries: int = 0
    """Distinct storage regions currently referenced by saved tensors and tracked as entries (a
    storage under ``min_bytes`` is not: Note [a small save skips the cache])."""
    live_disk_bytes: int = 0
    """Bytes of extents on storage still referenced (0 once every graph is gone)."""
    host_tier_bytes: int = 0
    """Bytes of the host tier (pinned host memory, for CUDA saves) in use now."""
    host_tier_peak_bytes: int = 0
    """The most bytes of the host tier ever in use at once."""
    host_tier_pinned_bytes: int = 0
    """Host memory pinned for the tier so far (it grows in slabs as it fills, up to ``host_bytes``)."""
    host_copied_bytes: int = 0
    """Bytes copied from the GPU into the host tier (included in ``written_bytes``)."""
    host_read_bytes: int = 0
    """Bytes copied back from the host tier to the GPU (included in ``read_bytes``)."""
    spilled_bytes: int = 0
    """Bytes the host tier could not take (full, or still being pinned), sent to the drives or kept."""
    host_copy_limit_bytes: int | None = None
    """Bytes a forward of the reference's length may copy to the host tier now: what the copy
    engine moves in that forward's device time, or less where the host sets forward's pace (Note
    [the host paces the copies] in ``copy_clock.py``); a forward of another length may copy in
    proportion (Note [a copy clock for forwards of any length]); ``None`` while not learned (every
    save is copied)."""
    written_bytes_by_path: dict[str, int] = dataclasses.field(default_factory=dict)
    microbatches: dict[Any, dict[str, Any]] = dataclasses.field(default_factory=dict)
    """Per micro-batch id: the same counters, for that micro-batch's saves."""
    endurance: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Drive-writes-per-day projection per path (see ``ssdtrain.store.endurance``)."""

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def peak_fall_share(self) -> float | None:
        """``peak_fall_bytes / peak_bound_bytes``: how much of the possible the peak fell by."""
        return self.peak_fall_bytes / self.peak_bound_bytes if self.peak_bound_bytes else None

    @property
    def prefetch_hit_rate(self) -> float:
        total = self.prefetch_hits + self.prefetch_misses
        return self.prefetch_hits / total if total else 1.0


_SCOPE_FIELDS = ("saved_bytes", "unique_bytes", "written_bytes", "read_bytes", "kept_bytes", "forwarded_bytes",
                 "adaptive_keep_bytes", "budget_kept_bytes", "stall_seconds", "prefetch_hits", "prefetch_misses")
_SCOPE_SET = frozenset(_SCOPE_FIELDS)


class Counters:
    """The mutable side: updated under the offloader's lock, copied into :class:`OffloadStats`."""

    def __init__(self) -> None:
        self.total = OffloadStats()
        self.per_scope: dict[Any, dict[str, Any]] = {}
        self.timeline: list[tuple[float, int]] | None = None
        self.forward_peak = 0  # the most resident since the last forward began

    def add(self, scope_id: Any, field: str, amount: float) -> None:
        total = self.total
        total.__dict__[field] += amount  # OffloadStats has no slots: its fields live in __dict__
        if scope_id is not None and field in _SCOPE_SET:  # a step's saves have none: most calls end here
            self._per(scope_id)[field] += amount

    def _per(self, scope_id: Any) -> dict[str, Any]:
        """A micro-batch's own counts (made at its first)."""
        per = self.per_scope.get(scope_id)
        if per is None:
            per = self.per_scope[scope_id] = dict.fromkeys(_SCOPE_FIELDS, 0)
        return per

    def kept_new(self, scope_id: Any, nbytes: int, why: str | None) -> None:
        """A storage held as it is, first saved now (``SmallSaves.add``): its bytes add to the
        unique, kept and resident bytes, and to ``why`` (a counter) if given: one call instead of
        four on the path most of a GPU forward's saves take (``resident``'s work inline: the
        bytes only grow here)."""
        total = self.total
        total.unique_bytes += nbytes
        total.kept_bytes += nbytes
        if why == "budget_kept_bytes":
            total.budget_kept_bytes += nbytes
        elif why is not None:
            setattr(total, why, getattr(total, why) + nbytes)
        if scope_id is not None:
            per = self._per(scope_id)
            per["unique_bytes"] += nbytes
            per["kept_bytes"] += nbytes
            if why in _SCOPE_SET:
                per[why] += nbytes
        now = total.resident_bytes = total.resident_bytes + nbytes
        if now > total.peak_resident_bytes:
            total.peak_resident_bytes = now
        if now > self.forward_peak:
            self.forward_peak = now
        if self.timeline is not None:
            self.timeline.append((time.perf_counter(), now))

    def joined(self, scope_id: Any, saved: int, unique: int) -> None:
        """A new storage of ``unique`` bytes joined a group by a save of ``saved`` bytes
        (``group.join``, or opened one: ``group.start``): the three counts of its path in one call,
        as :meth:`kept_new` does."""
        if scope_id is None:
            total = self.total
            total.saved_bytes += saved
            total.unique_bytes += unique
        else:
            self.add(scope_id, "saved_bytes", saved)
            self.add(scope_id, "unique_bytes", unique)
        self.resident(unique)

    def resident(self, delta: int) -> None:
        t = self.total
        # Never below zero: an interrupted state change can leave the count off until wait()
        # derives it again from the entries (Cache.recount).
        now = t.resident_bytes + delta
        if now < 0:
            now = 0
        t.resident_bytes = now
        if now > t.peak_resident_bytes:
            t.peak_resident_bytes = now
        if now > self.forward_peak:
            self.forward_peak = now
        if self.timeline is not None:
            self.timeline.append((time.perf_counter(), now))

    def reset_peak(self) -> None:
        self.total.peak_resident_bytes = self.total.resident_bytes

    def record_timeline(self, enabled: bool) -> list[tuple[float, int]]:
        if enabled:
            self.timeline = []
            return self.timeline
        timeline, self.timeline = self.timeline or [], None
        return timeline

    def snapshot(self) -> OffloadStats:
        snap = dataclasses.replace(self.total)
        snap.microbatches = {k: dict(v) for k, v in self.per_scope.items()}
        return snap
