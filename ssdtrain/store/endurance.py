"""What offloading does to a drive's lifetime: drive writes per day and time to rated endurance.

Flash wears out with bytes written. Vendors rate a drive for a number of terabytes written (TBW)
or drive writes per day (DWPD) over its warranty. Offloading activations writes every step's
activations once, which at several GB/s is a lot: this module turns the bytes the offloader wrote
into those two figures and warns once when, at the current rate, the drive's rated TBW would be
used up within a horizon.

Paths on the same filesystem share one drive: the drive's rate is the sum of theirs.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Sequence

from ssdtrain.store import _fs

__all__ = ["EnduranceMonitor", "drive_writes_per_day", "days_to_rated_tbw"]

TB = 1e12
DAY = 86400.0


def drive_writes_per_day(bytes_per_second: float, capacity_bytes: int) -> float:
    """How many times per day a drive of ``capacity_bytes`` is written over at this rate."""
    if capacity_bytes <= 0:
        return math.inf if bytes_per_second > 0 else 0.0
    return bytes_per_second * DAY / capacity_bytes


def days_to_rated_tbw(bytes_per_second: float, rated_tbw: float) -> float:
    """Days until ``rated_tbw`` terabytes (10^12 bytes) are written at this rate (inf at 0)."""
    if bytes_per_second <= 0:
        return math.inf
    return rated_tbw * TB / bytes_per_second / DAY


class EnduranceMonitor:
    """Counts bytes written per path and projects the drives' wear at the current rate.

    The rate is the average since the monitor was created: idle time counts, as it does for the
    drive. :meth:`record` is cheap and thread-safe (called from I/O threads); :meth:`check` and
    :meth:`projection` are meant for step boundaries and ``stats()``.

    Args:
        paths: the offload directories, in the engine's path order (``record``'s index).
        rated_tbw: the drives' rated endurance in TB written; ``None`` disables the warning.
        horizon_days: warn if the rated TBW would be reached sooner than this.
        min_seconds: no projection-based warning before this much time has passed (the rate of
            the first seconds says little).
        capacities: drive capacity in bytes per path; default: the size of each path's filesystem.
        clock: seconds, monotonic (tests pass a fake one).
    """

    def __init__(
        self,
        paths: Sequence[str | os.PathLike],
        rated_tbw: float | None = None,
        horizon_days: float = 365.0,
        *,
        min_seconds: float = 60.0,
        capacities: Sequence[int] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if rated_tbw is not None and not rated_tbw > 0:
            raise ValueError(f"rated_tbw={rated_tbw!r} must be > 0 terabytes, or None")
        if not horizon_days > 0:
            raise ValueError(f"horizon_days={horizon_days!r} must be > 0")
        self.paths = [os.fspath(p) for p in paths]
        if capacities is not None and len(capacities) != len(self.paths):
            raise ValueError(f"capacities has {len(capacities)} entries for {len(self.paths)} paths")
        self.rated_tbw = rated_tbw
        self.horizon_days = horizon_days
        self.min_seconds = min_seconds
        self._clock = clock
        self._start = clock()
        self._lock = threading.Lock()
        self._written = [0] * len(self.paths)
        self._warned = False
        self._capacity = list(capacities) if capacities is not None else [_fs.total_bytes(p) for p in self.paths]
        # Paths on one filesystem share a drive; group them by device number.
        self._drive = [self._device(p, i) for i, p in enumerate(self.paths)]

    @staticmethod
    def _device(path: str, index: int) -> object:
        try:
            return os.stat(path).st_dev
        except OSError:
            return ("path", index)

    def record(self, path_index: int, nbytes: int) -> None:
        """Counts ``nbytes`` written to ``paths[path_index]``."""
        with self._lock:
            self._written[path_index] += nbytes

    def written_bytes(self) -> dict[str, int]:
        """Bytes recorded per path."""
        with self._lock:
            return dict(zip(self.paths, self._written))

    def projection(self) -> dict:
        """The current figures, per path.

        Returns:
            ``{"elapsed_seconds", "rated_tbw", "horizon_days", "paths": [{"path", "written_bytes",
            "bytes_per_second", "capacity_bytes", "drive_bytes_per_second",
            "drive_writes_per_day", "days_to_rated_tbw"}, ...]}``; the ``drive_*`` and
            ``days_*`` figures are those of the drive holding the path (all paths on it
            together); ``days_to_rated_tbw`` is ``None`` without ``rated_tbw`` or before any write.
        """
        with self._lock:
            written = list(self._written)
        elapsed = max(self._clock() - self._start, 1e-9)
        rates = [w / elapsed for w in written]
        drive_rate: dict[object, float] = {}
        for dev, r in zip(self._drive, rates):
            drive_rate[dev] = drive_rate.get(dev, 0.0) + r
        out = []
        for i, path in enumerate(self.paths):
            dr = drive_rate[self._drive[i]]
            days = days_to_rated_tbw(dr, self.rated_tbw) if self.rated_tbw else math.inf
            out.append({
                "path": path,
                "written_bytes": written[i],
                "bytes_per_second": rates[i],
                "capacity_bytes": self._capacity[i],
                "drive_bytes_per_second": dr,
                "drive_writes_per_day": drive_writes_per_day(dr, self._capacity[i]),
                "days_to_rated_tbw": None if math.isinf(days) else days,
            })
        return {
            "elapsed_seconds": elapsed,
            "rated_tbw": self.rated_tbw,
            "horizon_days": self.horizon_days,
            "paths": out,
        }

    def check(self) -> str | None:
        """A warning message, the first time the rated TBW would be reached within the horizon;
        ``None`` otherwise (and on every later call)."""
        if self._warned or self.rated_tbw is None:
            return None
        if self._clock() - self._start < self.min_seconds:
            return None
        proj = self.projection()
        soon = [p for p in proj["paths"] if p["days_to_rated_tbw"] is not None
                and p["days_to_rated_tbw"] < self.horizon_days]
        if not soon:
            return None
        self._warned = True
        worst = min(soon, key=lambda p: p["days_to_rated_tbw"])
        where = ", ".join(p["path"] for p in soon)
        return (
            f"ssdtrain: at the current offload write rate of {worst['drive_bytes_per_second'] / 1e9:.2f} GB/s "
            f"({worst['drive_writes_per_day']:.1f} drive writes per day), a drive rated for "
            f"{self.rated_tbw:g} TBW would reach it in {worst['days_to_rated_tbw']:.0f} days, within the "
            f"{self.horizon_days:g}-day horizon (paths: {where}). Offload less (raise min_bytes or "
            "keep_last_layers), spread over more drives, or set rated_tbw/endurance_horizon_days to "
            "match your drives."
        )
