"""When to keep, and what to read ahead: micro-batch scopes, the read-ahead window, the write budget.

Plain objects over :class:`~ssdtrain.engine.cache.Entry` objects, with no threads and no I/O: the engine
calls them under its lock, feeds them the times and byte counts it measured, and performs
whatever I/O they decide. Their tests drive them with made-up clocks and numbers.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from typing import Any

from torch import nn

from ssdtrain._units import fmt_bytes
from ssdtrain.engine.cache import Entry, State

__all__ = ["Scope", "Scopes", "KeepPolicy", "ReadWindow", "Tally", "WriteBudget", "find_blocks"]

# Note [a window as small as the drive allows]: the share of a period that backward may wait on
# reads before the read-ahead window doubles (at the next backward pass), and the share that
# doubles it at once. A wait is time the step loses outright, while the memory a larger window
# holds is bounded by ``prefetch_bytes``; so the budget is a quarter of a percent. At 1% the
# bench model settled on a 32 MiB window and waited 0.7% of every step; at 0.25% the median
# step waits for nothing.
STALL_BUDGET = 0.0025
STALL_RUSH = 0.10
# Note [write only what comes back in time]: a step whose reads kept backward waiting for more
# than this share of it was sent more than the drive can return: the write budget shrinks.
# Smaller waits are the read-ahead window's to fix (it grows); a drive that cannot carry the
# bytes makes backward wait far longer than this, at every step.
DRIVE_BOUND = 0.01
MIN_DRIVE_STALL = 0.010  # seconds: waits shorter than this are a read's latency, not a drive too slow
BUDGET_GROWTH = 1.10
BUDGET_FLOOR = 0.5  # at most halve the budget at once: one slow step must not zero it

class Scope:
    """One micro-batch (or one ``with off:`` step): its saves in pack order, its backward state.

    ``cursor`` walks down the pack order during backward: entries above it have been considered
    for prefetch in this pass; ``ahead`` counts bytes read ahead and not yet used.
    """

    def __init__(self, scope_id: Any, *, stats_id: Any = None) -> None:
        self.id = scope_id
        self.stats_id = stats_id
        self.order: list[Entry] = []
        self.backward_started = False
        self.passes = 0          # backward passes seen (retain_graph runs more than one)
        self.live_entries = 0
        self.cursor = -1
        self.ahead = 0
        self.top_layer: int | None = None
        self.armed = False       # backward announced, nothing unpacked yet
        self.held: Entry | None = None  # the last save, its write not queued yet (engine's Note)
        self.group: Any = None  # its open group (Note [saves handed over together share an entry])
        self.resume: list[int] = []  # cursors to go back to (Note [backward that jumps down the pack order])
        self.missed_at: int | None = None  # where backward last needed a save the read-ahead had not reached
        self.op: object = None  # the op that saved last (Note [a save is copied only after its op returned])
        self.fresh: list[Entry] = []  # queued by that op's saves: written once it returned
        self.tally: Tally | None = None  # its forward's, in the write budget
        self.unique_at_start = 0  # the offloader's unique bytes when its forward began
        self.resident_at_start = 0  # ... and its resident bytes
        self.layer_now: int | None = None  # the block backward was last seen in

    def add(self, entry: Entry) -> None:
        entry.pos = len(self.order)
        self.order.append(entry)
        if entry.layer is not None and (self.top_layer is None or entry.layer > self.top_layer):
            self.top_layer = entry.layer

    def queued(self) -> list[Entry]:
        """Entries whose write has not started, most recently packed first."""
        return [e for e in reversed(self.order) if e.state is State.QUEUED]

    def restart(self) -> None:
        """A backward pass starts over the whole pack order."""
        self.cursor = len(self.order) - 1
        self.ahead = 0
        self.armed = True
        self.resume.clear()
        self.missed_at = None
        for e in self.order:
            e.counted_ahead = False

    def advance(self, layer: int | None, *, max_bytes: int, max_layers: int | None,
                strict: bool = False) -> list[Entry]:
        """Entries to read now: the next ones, going down the pack order from the cursor.

        Backward needs entries roughly in reverse pack order. The cursor never jumps to where
        backward is: a save needed out of order (an input saved first and used last, a dedup'd
        tensor) must not make the window skip everything between; entries it has passed and
        not read are read on demand. The window holds at most ``max_bytes`` read ahead and
        unused and, with block tags and ``max_layers`` set, reaches at most ``max_layers`` blocks
        below the running ``layer``; only the first entry read ahead may overshoot it, and none
        when ``strict`` (a step's peak caps it). Amortised O(1): the cursor only moves down.
        """
        if layer is None:
            # Above the blocks (head, loss): the window counts from the top block.
            layer = self.top_layer
        picked: list[Entry] = []
        while self.ahead < max_bytes:
            if self.cursor < 0:
                if not self.resume:
                    break
                self.cursor = self.resume.pop()  # Note [backward that jumps down the pack order]
                continue
            e = self.order[self.cursor]
            if max_layers is not None and layer is not None and e.layer is not None and e.layer < layer - max_layers:
                break
            if (self.ahead or strict) and self.ahead + e.nbytes > max_bytes and e.state is State.ON_DISK:
                break  # the first may overshoot the window (else nothing large is read ahead), unless strict
            self.cursor -= 1
            if e.refs <= 0 or e.error is not None:
                continue
            if e.state is State.ON_DISK:
                if e.loaded is None and e.read_future is None and not (
                        e.loaded_weak is not None and e.loaded_weak() is not None):
                    e.counted_ahead = True
                    self.ahead += e.nbytes
                    picked.append(e)
            elif e.state in (State.WRITING, State.WRITTEN):
                # Still in memory, and about to be needed: it stays (see the engine's drain) and
                # takes its place in the window instead of a read.
                e.counted_ahead = True
                self.ahead += e.nbytes
        return picked

    # Note [backward that jumps down the pack order]
    # Autograd's unpack order is unspecified (torch PR 198016); mostly it is the reverse of the pack
    # order, and the read-ahead walks down from the top. It is not: when backward runs in calls of
    # its own (a branch packed first, differentiated first), when ``torch.autograd.grad`` asks for
    # a subset (the other branch's saves are never unpacked), within a node (its saves come back
    # in the order saved). A single save needed before the read-ahead reached it (an input saved
    # early, a storage saved again later) is read on demand, and the cursor stays: jumping to it
    # would skip everything between. Two in a row, the second below the first, mean backward goes
    # on down from there: the read-ahead jumps after it. What it read ahead above the jump and
    # backward has not used is given back (read again if needed), so that the window is free for
    # where backward is; its old position is kept, and the read-ahead goes back there once it has
    # walked to the bottom. Nothing is released for being passed: an entry leaves memory only
    # when its last saved reference dies, whatever the order.
    def missed(self, e: Entry) -> list[Entry]:
        """Backward needs ``e``, which the read-ahead has not read: returns the entries read ahead
        and not used to give back, if backward jumped down the pack order (the cursor then moves
        below ``e``), else nothing."""
        if e.pos > self.cursor:  # passed by the read-ahead (window, layers): not a jump
            self.missed_at = None
            return []
        first, self.missed_at = self.missed_at, e.pos
        if first is None or e.pos >= first:
            return []
        unused = [d for d in self.order[self.cursor + 1:] if d.counted_ahead and d.read_future is not None
                  and d.read_future.done() and d.refs > 0]
        top = max([self.cursor] + [d.pos for d in unused])
        for d in unused:
            self.used(d)
        self.resume.append(top)
        self.cursor = e.pos - 1
        self.missed_at = None
        return unused

    def drop(self, e: Entry) -> bool:
        """``e`` died; returns whether the scope holds no live entry any more."""
        self.used(e)
        self.live_entries -= 1
        if self.held is e:
            self.held = None
        if self.group is e:
            self.group = None
        if e in self.fresh:
            self.fresh.remove(e)
        return self.live_entries == 0

    def used(self, e: Entry) -> None:
        """``e``'s read-ahead bytes leave the window (first use, or freed)."""
        if e.counted_ahead:
            e.counted_ahead = False
            self.ahead -= e.nbytes

    def __repr__(self) -> str:
        return f"Scope({self.id!r}, {len(self.order)} entries)"


class Scopes:
    """The scopes with saves alive (``by_id``), and the activations in progress (``with off:``,
    ``off.microbatch``) as ``[pack hook, scope]`` records, innermost last (``active``; the pack
    hook is ``None`` for hooks entered by hand)."""

    def __init__(self, on_forget: Callable[[Scope], None] | None = None) -> None:
        self.by_id: dict[Any, Scope] = {}
        self.active: list[list] = []
        self._steps = itertools.count()
        self._on_forget = on_forget  # told of each scope forgotten (its backward is over)

    def new_step(self) -> Scope:
        return Scope(("step", next(self._steps)))

    def opened_by(self, owner: Any) -> bool:
        """Whether a block of ``owner`` (``with off:``, ``off.microbatch``) is open: its pack
        hook is a method of ``owner``."""
        return any(getattr(r[0], "__self__", None) is owner for r in self.active)

    def in_forward(self) -> list[Scope]:
        return [s for s in self.by_id.values() if not s.backward_started]

    def restart_armed(self, completed: Any) -> list[Scope]:
        """``wait()`` with backward announced and nothing unpacked yet: the window kept what it
        passed in memory, so each such scope starts over, and its writes that finished before
        now (settled earlier, kept for the window) go through the drain again (``completed``).
        Returns those scopes."""
        armed = [s for s in self.by_id.values() if s.armed]
        for scope in armed:
            scope.restart()
            completed.extend(e for e in scope.order if e.state is State.WRITTEN)
        return armed

    def forget_if_empty(self, scope: Scope) -> None:
        """A scope with nothing saved and no activation has nothing to read back."""
        if scope.live_entries == 0 and self.by_id.get(scope.id) is scope and all(r[1] is not scope
                                                                                for r in self.active):
            del self.by_id[scope.id]
            scope.order = []  # Note [a freed entry is in no cycle]
            if self._on_forget is not None:
                self._on_forget(scope)

    def current(self, *, in_backward: bool) -> tuple[Scope, Scope | None]:
        """The scope saves go to now, and the step it just replaced (``None`` if none was).

        With ``with off:`` around a whole loop, a forward that follows a backward starts the next
        step; saves made by a backward pass itself (``in_backward``) stay in its scope, and
        micro-batch scopes are never replaced. Hooks entered by hand (no activation) get a step.
        """
        if not self.active:
            scope = self.new_step()
            self.active.append([None, scope])
            self.by_id[scope.id] = scope
        rec = self.active[-1]
        if rec[1].backward_started and not in_backward and rec[1].stats_id is None:
            done, rec[1] = rec[1], self.new_step()
            return rec[1], done
        return rec[1], None


class ReadWindow:
    """How many bytes backward may hold read ahead of need.

    Two parts. A *window* sized by the drive: Note [a window as small as the drive allows]. It
    starts at ``floor`` and is resized once per backward pass from what the period before cost:
    doubled (up to ``cap``) when backward waited on reads for more than ``STALL_BUDGET`` of it,
    shrunk by a quarter after a period with no wait; a drive far too slow for it doubles it at
    once (``STALL_RUSH``). And the room backward has *freed*: Note [reads never raise the
    peak]. Saved bytes resident when a backward pass begins are the step's peak; as backward
    uses and frees them, reads may fill the same room, so a slow drive starts reading long
    before the tensors are needed, at no cost in peak memory.
    """

    def __init__(self, floor: int, cap: int, now: float) -> None:
        self.floor = self.bytes = min(floor, cap)
        self.cap = cap
        self.ceiling = 0
        self.peak: int | None = None
        self._start = now
        self._stall = 0.0
        self._misses = 0
        self._last = 0.0

    def begin_pass(self, now: float, resident: int, peak: int | None = None) -> None:
        """A backward pass begins with ``resident`` saved bytes in memory; ``peak``: the most its
        step's forward held (a step's, not a micro-batch's: a stage's peak is elsewhere), which
        reads never exceed."""
        elapsed = now - self._start
        if self._stall > STALL_BUDGET * elapsed:
            self.bytes = min(2 * self.bytes, self.cap)
        elif self._misses == 0:
            self.bytes = max(self.floor, self.bytes - self.bytes // 4)
        self._start, self._stall, self._misses, self._last = now, 0.0, 0, elapsed
        self.ceiling = resident
        self.peak = None if peak is None else max(peak, resident)

    def stalled(self, now: float, waited: float) -> None:
        """Backward waited ``waited`` seconds for a read."""
        self._misses += 1
        self._stall += waited
        # Against the last pass's length too: waits right after a pass starts are common.
        if self._stall > STALL_RUSH * max(now - self._start, self._last):
            self.bytes = min(2 * self.bytes, self.cap)
            self._start, self._stall = now, 0.0

    def limit(self, resident: int, ahead: int) -> int:
        """Bytes a scope may hold read ahead, with ``resident`` saved bytes in memory of which
        ``ahead`` are read ahead already."""
        if self.cap == 0:
            return 0  # prefetch_bytes=0: no read-ahead at all
        held = resident - ahead  # no builtins: asked at every unpack (Note [unpack's common case without calls])
        limit = self.bytes + (self.ceiling - held if self.ceiling > held else 0)
        if self.peak is not None:  # Note [reads never raise the peak]: not the step's either
            room = self.peak - held if self.peak > held else 0
            if room < limit:
                limit = room
        return limit


class Tally:
    """What one forward (a step, or a micro-batch) of the :class:`WriteBudget` did: the limit it
    was sent under, the bytes it was allowed (``sent``; ``bound`` if the limit held some back),
    the bytes of it written, and how long backward waited on reading it back."""

    __slots__ = ("limit", "sent", "bound", "written", "stall")

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.sent, self.bound, self.written, self.stall = 0, False, 0, 0.0


# Note [say when the drive carries little]
# In the drive-limited regime (every GPU with one NVMe drive) the write budget keeps what the drive
# cannot bring back in time, so a step never waits, and offloading may then save next to nothing:
# on an H100 with a 2 GB/s drive, 53 MiB of the 7.1 GiB a step saved (2026-11-24). Nothing breaks,
# and nothing tells the user that the memory they count on is not being saved, while every save
# still costs the training thread its bookkeeping. So once the budget had time to settle, if the
# drive took under ``share`` of what the last ``span`` forwards saved while the budget, adaptive
# keep and the peak rule kept most of it (the peak rule's share was left out until 2026-11-27:
# on a loaded machine, where it keeps most, the warning did not come), the offloader warns once,
# with the figures and the remedy: checkpoint the blocks and offload only their inputs (17 times
# fewer bytes per layer), or plan it first.
class DriveAdvice:
    """Once, a message saying the drive carries little of what forward saves (see the Note)."""

    def __init__(self, *, after: int = 8, span: int = 4, share: float = 0.05) -> None:
        self.after, self.span, self.share = after, span, share
        self.forwards = 0
        self.given = False
        self._marks: deque[tuple[float, float, float]] = deque(maxlen=span + 1)

    def observe(self, unique: float, written: float, drive_kept: float) -> str | None:
        """At each forward's end: running totals of the bytes saved (each storage once), written,
        and kept for the drive's sake (budget, adaptive keep, and the peak rule: a write that would
        end after the peak). Returns the message, once."""
        if self.given:
            return None
        self.forwards += 1
        self._marks.append((unique, written, drive_kept))
        if self.forwards < self.after or len(self._marks) <= self.span:
            return None
        (u0, w0, k0), (u1, w1, k1) = self._marks[0], self._marks[-1]
        saved, wrote, kept = u1 - u0, w1 - w0, k1 - k0
        if saved <= 0 or wrote > self.share * saved or 2 * kept < saved:
            return None
        self.given = True
        return (f"ssdtrain: the drive took {100 * wrote / saved:.1f}% of what the last {self.span} forwards saved "
                f"({fmt_bytes(wrote / self.span)} of {fmt_bytes(saved / self.span)} per forward); the rest stayed in "
                "memory because the drive could not take more before the peak or bring more back in time "
                "(stats().peak_kept_bytes, budget_kept_bytes, adaptive_keep_bytes), so offloading saves little memory "
                "here. With activation checkpointing "
                "(torch.utils.checkpoint per block inside `with off:`, and min_bytes=0) only block inputs are saved, "
                "about 17 times fewer bytes, which a drive can carry; `ssdtrain plan` estimates what yours takes. "
                "(This warning is given once.)")


class WriteBudget:
    """How many bytes a step may send to the drive: Note [write only what comes back in time].

    Writes are queued in pack order and those still queued when backward begins are cancelled,
    so a step never writes more than the drive takes during forward. What it writes must also
    come back before backward needs it. That is learned, with no profiling pass: a step whose
    backward waited on reads for more than ``DRIVE_BOUND`` of a step had sent too much, and the
    next steps may send less (what it wrote, less in proportion to the wait, at most halved at
    once); a step that was held back by the budget and did not wait lets it grow by a tenth.
    The earliest saves of a step use the budget first: backward needs them last, which leaves
    their reads the most time.

    Each forward has its :class:`Tally` (:meth:`new_step` opens it); the writes and the waits
    of its saves are charged to it, and it is learned from when its backward is over
    (:meth:`finish`). In a pipeline that is several forwards later: under 1F1B, micro-batch
    ``i``'s backward runs after forward ``i + stages - 1``, so the micro-batches sent before a
    change of the limit all wait, and each would halve it again (measured: 74 MiB down to 1
    MiB, then a slow climb back and the same again, with stalls each time). Charged to the
    forward that caused it, a wait lowers the limit to what that forward wrote, less the wait's
    share: never below what the forward sent under the current limit warrants. Only a forward
    sent under the limit as it stands can raise it. A *step* is the time between two forwards'
    starts (a pipeline's slot), the measure of a wait's cost.
    """

    def __init__(self, now: float, step: int) -> None:
        self.limit: int | None = None  # None: no limit learned (yet)
        self.step = step  # what the budget grows by at least, so it can grow from nothing
        self.current = Tally(None)  # the forward in progress
        self._start = now
        self._period: float | None = None  # the last step (time between two forwards' starts)

    def allows(self, nbytes: int) -> bool:
        """Whether a write of ``nbytes`` fits the current forward's budget (and counts it if so)."""
        t = self.current
        if self.limit is not None and t.sent + nbytes > self.limit:
            t.bound = True
            return False
        t.sent += nbytes
        return True

    def stalled(self, waited: float, tally: Tally | None = None) -> None:
        """Backward waited ``waited`` s to read back a save of ``tally``'s forward (the current one)."""
        (tally or self.current).stall += waited

    def written(self, nbytes: int, tally: Tally | None = None) -> None:
        """``nbytes`` of ``tally``'s forward (the current one) reached the drive."""
        (tally or self.current).written += nbytes

    def new_step(self, now: float) -> Tally:
        """A forward begins: returns its tally."""
        if now > self._start:
            self._period = now - self._start
        self._start = now
        self.current = Tally(self.limit)
        return self.current

    def finish(self, tally: Tally, now: float) -> None:
        """``tally``'s backward is over (its saves are gone): learn from what it sent and waited."""
        # The step this backward ends: since the current forward began (the whole step when
        # forwards and backwards alternate; a slot under 1F1B), or the last whole one if longer.
        period = max(now - self._start, self._period or 0.0)
        if period <= 0:
            return
        if tally.stall > max(DRIVE_BOUND * period, MIN_DRIVE_STALL):
            base = tally.written if tally.limit is None else min(tally.limit, tally.written)
            shrink = max(BUDGET_FLOOR, 1.0 - 2.0 * tally.stall / period)
            self.limit = int(base * shrink) if self.limit is None else min(self.limit, int(base * shrink))
        elif tally.limit == self.limit is not None and tally.bound and tally.stall <= STALL_BUDGET * period:
            # Only a forward sent under the limit as it is now tested it: one sent under a higher
            # limit since lowered, or a lower one since raised, says nothing of it.
            self.limit = int(self.limit * BUDGET_GROWTH) + self.step


class KeepPolicy:
    """Whether a new entry is written or kept in memory, and why.

    Args:
        min_bytes: smaller entries are kept (their I/O costs more than it frees).
        keep_from_layer: entries of this block and later ones are kept (``keep_last_layers``);
            ``None``: none is.
        when_full: what happens with no room in the write queue (``max_inflight_bytes``):
            ``"keep"`` keeps the entry, ``"wait"`` waits for room and writes it.
        budget: the :class:`WriteBudget`, consulted with ``when_full="keep"`` only (a strict
            memory bound writes everything, whatever it costs in waiting).
    """

    def __init__(self, *, min_bytes: int, keep_from_layer: int | None, when_full: str, budget: WriteBudget) -> None:
        self.min_bytes = min_bytes
        self.keep_from_layer = keep_from_layer
        self.when_full = when_full
        self.budget = budget

    def decide(self, nbytes: int, layer: int | None, has_room: bool, budget: Any = None, late: bool = False) -> str:
        """``"write"``; ``"wait"`` (for room, then write); or why the entry is kept: ``"small"``,
        ``"last_layers"``, ``"full"`` (no room), ``"late"`` (its write would end after the peak:
        ``late``, Note [write what leaves before the peak] in ``peak.py``) or ``"budget"`` (Note
        [write only what comes back in time]). ``budget``: another budget to consult (the host
        tier's, for its saves)."""
        if nbytes < self.min_bytes:
            return "small"
        if self.keep_from_layer is not None and layer is not None and layer >= self.keep_from_layer:
            return "last_layers"
        if not has_room:
            return "full" if self.when_full == "keep" else "wait"
        if late and self.when_full == "keep":
            return "late"
        if self.when_full == "keep" and not (budget or self.budget).allows(nbytes):
            return "budget"
        return "write"


def find_blocks(model: nn.Module, dotted: str | None) -> list[nn.Module]:
    """The model's repeated blocks: ``dotted`` if given, else its largest same-typed ModuleList.

    Raises:
        ValueError: when ``dotted`` does not name an ``nn.ModuleList`` or ``nn.Sequential`` of ``model``.
    """
    if dotted is not None:
        obj: Any = model
        for part in dotted.split("."):
            if not hasattr(obj, part):
                raise ValueError(f"layers={dotted!r}: {type(obj).__name__} has no attribute {part!r}; "
                                 "give the dotted name of the model's list of blocks")
            obj = getattr(obj, part)
        if not isinstance(obj, (nn.ModuleList, nn.Sequential)):
            raise ValueError(f"layers={dotted!r} is a {type(obj).__name__}, not an nn.ModuleList of blocks")
        return list(obj)
    best: list[nn.Module] = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) >= 2:
            kinds = {type(m) for m in module}
            if len(kinds) == 1 and len(module) > len(best):
                best = list(module)
    return best
