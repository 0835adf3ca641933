"""A drive modelled on a fake clock: writes finish one after another at a set rate, when the test
advances the clock; reads finish when waited for (tests only)."""

from __future__ import annotations

import math

from _manual_store import ManualStore


class ClockStore(ManualStore):
    """A FIFO drive of ``bps`` bytes per second on ``clock`` (a one-item list of seconds): a write
    submitted at ``t`` finishes at ``max(t, the previous write's end) + nbytes / bps``, once
    :meth:`advance` moves the clock past that time (on the caller's thread, with the clock at
    that time)."""

    name = "clock"

    def __init__(self, clock: list[float], bps: float) -> None:
        super().__init__()
        self.clock, self.bps = clock, bps
        self._busy_until = -math.inf
        self._ends: list[float] = []  # modelled end of each pending write, in submission order

    def submit_write(self, extent, src, *, checksum=False, ready=None):
        fut = super().submit_write(extent, src, checksum=checksum, ready=ready)
        self._busy_until = max(self.clock[0], self._busy_until) + extent.nbytes / self.bps
        self._ends.append(self._busy_until)
        return fut

    def advance(self, to: float) -> None:
        """Finishes, in order, the writes whose modelled end is at or before ``to`` (``inf``: all
        of them), moving the clock to each end as it does."""
        while self._ends and self._ends[0] <= to:
            self.clock[0] = max(self.clock[0], self._ends.pop(0))  # time passes as the drive works
            self.complete_write(0)
        if to != math.inf:
            self.clock[0] = max(self.clock[0], to)
