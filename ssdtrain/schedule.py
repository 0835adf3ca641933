"""When to keep, and what to read ahead: layer scopes, micro-batch scopes, the prefetch window.

Pure bookkeeping over :class:`~ssdtrain.cache.Entry` objects; the engine calls it under its lock
and performs whatever I/O it decides.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ssdtrain.cache import Entry, State

__all__ = ["Scope", "find_blocks"]

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

    def add(self, entry: Entry) -> None:
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
        for e in self.order:
            e.counted_ahead = False

    def advance(self, layer: int | None, *, max_bytes: int, max_layers: int) -> list[Entry]:
        """Entries to read now: the next ones, going down the pack order from the cursor.

        Backward needs entries roughly in reverse pack order. The cursor never jumps to where
        backward is: a save needed out of order (an input saved first and used last, a dedup'd
        tensor) must not make the window skip everything between; entries it has passed and
        not read are read on demand. The window holds at most
        ``max_bytes`` read ahead and unused and, with block tags, reaches at most ``max_layers``
        blocks below the running ``layer``. Amortised O(1): the cursor only moves down.
        """
        if layer is None:
            # Above the blocks (head, loss): the window counts from the top block.
            layer = self.top_layer
        picked: list[Entry] = []
        while self.cursor >= 0 and self.ahead < max_bytes:
            e = self.order[self.cursor]
            if layer is not None and e.layer is not None and e.layer < layer - max_layers:
                break
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

    def used(self, e: Entry) -> None:
        """``e``'s read-ahead bytes leave the window (first use, or freed)."""
        if e.counted_ahead:
            e.counted_ahead = False
            self.ahead -= e.nbytes

    def __repr__(self) -> str:
        return f"Scope({self.id!r}, {len(self.order)} entries)"


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
