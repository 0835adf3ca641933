"""``ssdtrain.offload``: an :class:`~ssdtrain.Offloader`, or, when switched off by a flag, an
object with the same surface that does nothing."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from ssdtrain.config import OffloadConfig
from ssdtrain.engine.stats import OffloadStats

__all__ = ["offload"]


def offload(model: Any = None, *, enabled: bool = True, **overrides: Any) -> Any:
    """``Offloader(model, **overrides)``; with ``enabled=False`` an object with the same surface
    that offloads nothing (settings are still checked), so that a flag can switch it."""
    if not enabled:
        OffloadConfig.from_dict({k: v for k, v in overrides.items() if k != "keep_modules"})
        return Disabled()
    from ssdtrain.engine.offloader import Offloader

    return Offloader(model, **overrides)


class Disabled:
    """What ``offload(..., enabled=False)`` returns: the Offloader's surface, doing nothing."""

    backend = "disabled"

    def __enter__(self) -> Disabled:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    @contextlib.contextmanager
    def microbatch(self, mb_id: Any) -> Iterator[Disabled]:
        yield self

    def prefetch(self, mb_id: Any) -> None: ...
    def wait(self) -> None: ...
    def reset_peak(self) -> None: ...
    def close(self) -> None: ...

    def stats(self) -> OffloadStats:
        return OffloadStats(backend="disabled")

    def record_timeline(self, enabled: bool = True) -> list[tuple[float, int]]:
        return []
