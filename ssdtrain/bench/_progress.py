"""A one-line progress bar on stderr, for ``ssdtrain bench`` and ``ssdtrain probe``.

No dependencies. It draws only when the stream is a terminal (or ``enabled=True``), so logs and
CI output stay clean, and it erases itself on :meth:`Progress.close`::

    bar = Progress(total=12, label="bench")
    for i in range(12):
        ...
        bar.update(note=f"offload step {i}")
    bar.close()
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    """Counts ``done`` out of ``total`` units and redraws ``label [####....] 33% note``.

    Args:
        total: units of work (steps, bytes, ...); 0 means unknown (no bar, just the count).
        label: text before the bar.
        stream: where to draw; ``sys.stderr`` by default.
        enabled: force drawing on or off; default: only if ``stream`` is a terminal.
        width: characters in the bar.
        min_interval: seconds between redraws (the final state always draws).
    """

    def __init__(self, total: int, label: str = "", *, stream: TextIO | None = None,
                 enabled: bool | None = None, width: int = 30, min_interval: float = 0.05) -> None:
        self.total = max(0, int(total))
        self.done = 0
        self.label = label
        self.stream = sys.stderr if stream is None else stream
        if enabled is None:
            isatty = getattr(self.stream, "isatty", None)
            enabled = bool(isatty and isatty())
        self.enabled = enabled
        self.width = width
        self.min_interval = min_interval
        self._last_draw = 0.0
        self._shown = 0
        self._start = time.perf_counter()

    def render(self, note: str = "") -> str:
        """The line as it would be drawn now (without the carriage return)."""
        elapsed = time.perf_counter() - self._start
        if self.total:
            frac = min(1.0, self.done / self.total)
            filled = int(frac * self.width)
            bar = f"[{'#' * filled}{'.' * (self.width - filled)}] {frac:4.0%}"
        else:
            bar = f"{self.done}"
        parts = [p for p in (self.label, bar, f"{elapsed:5.0f}s", note) if p]
        return " ".join(parts)

    def update(self, n: int = 1, note: str = "") -> None:
        """Advance by ``n`` units and redraw (rate-limited)."""
        self.done += n
        self.draw(note, force=self.total > 0 and self.done >= self.total)

    def set(self, done: int, note: str = "") -> None:
        """Jump to ``done`` units and redraw (rate-limited)."""
        self.done = done
        self.draw(note, force=self.total > 0 and self.done >= self.total)

    def draw(self, note: str = "", *, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if not force and now - self._last_draw < self.min_interval:
            return
        self._last_draw = now
        line = self.render(note)
        pad = " " * max(0, self._shown - len(line))
        self.stream.write("\r" + line + pad)
        self.stream.flush()
        self._shown = len(line)

    def close(self) -> None:
        """Erase the bar (idempotent)."""
        if self.enabled and self._shown:
            self.stream.write("\r" + " " * self._shown + "\r")
            self.stream.flush()
            self._shown = 0

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
