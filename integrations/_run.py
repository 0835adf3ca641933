"""What the trainer callbacks share: settings checked when the callback is made, one
:class:`~ssdtrain.Offloader` per training run with the hooks that bracket its forwards, and the
run's stats after it ended. Each callback adds how its trainer's forwards are bracketed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import ssdtrain


class OffloadRun:
    """Mixed into ``OffloadCallback`` classes; call :meth:`_setup` from ``__init__``."""

    def _setup(self, fields: dict[str, Any]) -> None:
        self.config = ssdtrain.OffloadConfig.from_dict(fields)  # bad settings fail here, before training
        self._offloader: ssdtrain.Offloader | None = None
        self._hooks: Any = None  # what brackets the forwards; has remove()
        self._last_stats: ssdtrain.OffloadStats | None = None

    @property
    def offloader(self) -> ssdtrain.Offloader | None:
        """The offloader of the training run in progress (``None`` outside it)."""
        return self._offloader

    def stats(self) -> ssdtrain.OffloadStats:
        """Counters of the run in progress, or of the last one after it ended.

        Raises:
            RuntimeError: no training has started yet.
        """
        if self._offloader is not None:
            return self._offloader.stats()
        if self._last_stats is None:
            raise RuntimeError("OffloadCallback.stats(): no training has run with this callback yet")
        return self._last_stats

    def _start(self, module: torch.nn.Module,
               bracket: Callable[[torch.nn.Module, ssdtrain.Offloader], Any]) -> None:
        """A run begins: an Offloader for ``module`` (its parameters are never written, its
        repeated blocks order the reads in backward), and ``bracket(module, offloader)``."""
        self._offloader = ssdtrain.Offloader(module, self.config)
        try:
            self._hooks = bracket(module, self._offloader)
        except BaseException:
            self._offloader.close()
            self._offloader = None
            raise

    def _finish(self) -> None:
        """The run ends: hooks removed, stats kept, offloader closed; idempotent."""
        if self._hooks is not None:
            self._hooks.remove()
            self._hooks = None
        if self._offloader is not None:
            off, self._offloader = self._offloader, None
            try:
                self._last_stats = off.stats()
            finally:
                off.close()
