"""What a failed write leaves for the training thread (:class:`WriteFailures`; moved out of
``writer.py``, whose queue hands it each failure)."""

from __future__ import annotations

import warnings

__all__ = ["WriteFailures"]


class WriteFailures:
    """What a failed write leaves for the training thread (``on_error``): with ``"raise"``, the
    first error, raised at the next safe point that may raise; with ``"keep"``, one warning.
    Note [a failing drive does not corrupt training]: the bytes of a failed write never left
    memory, so its entry is simply kept."""

    def __init__(self, on_error: str) -> None:
        self._raise = on_error == "raise"
        self._error: BaseException | None = None
        self._warnings: list[str] = []
        self._warned = self.pending = False  # pending: a warning or an error waits for surface() (pack reads it)

    def failed(self, err: BaseException) -> None:
        if self._raise:
            if self._error is None:
                self._error = err
        elif not self._warned:
            self._warned = True
            self._warnings.append(f"ssdtrain: a write failed ({err}); on_error='keep': tensors that cannot be "
                                  "written stay in memory (see stats().failed_writes)")
        self.pending = True

    def surface(self, *, raise_errors: bool) -> None:
        """On the training thread: warns, and raises the error kept if ``raise_errors``."""
        while self._warnings:
            warnings.warn(self._warnings.pop(0), RuntimeWarning, stacklevel=4)
        if raise_errors and self._error is not None:
            err, self._error, self.pending = self._error, None, bool(self._warnings)
            raise err
        self.pending = self._error is not None or bool(self._warnings)
