"""A drive of a given speed for the offloaders that integrations make themselves (tests only)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import ssdtrain.engine.offloader as offloader_module
from ssdtrain.store.throttle import ThrottledBackend


@contextlib.contextmanager
def slow_drive(bps: float) -> Iterator[None]:
    """Every Offloader made inside gets its configured backend throttled to ``bps`` bytes/s each
    way (write and read)."""
    real_make = offloader_module.make_backend
    offloader_module.make_backend = lambda cfg: ThrottledBackend(real_make(cfg), write_bps=bps, read_bps=bps)
    try:
        yield
    finally:
        offloader_module.make_backend = real_make
