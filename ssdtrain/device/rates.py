"""What the modelled GPU charges: compute, memory and copy rates and the host's cost per call.

Every figure of the presets says where it came from: a measurement on record (the date and
machine), a datasheet, or an estimate. The modelled GPU (``model.py``) only multiplies by these;
its results are as good as the figures and are always labelled as modelled.
"""

from __future__ import annotations

import dataclasses
import math

__all__ = ["Rates", "H100", "H200"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rates:
    """Rates of a modelled GPU and of the host thread that drives it.

    A kernel takes ``max(flops / flops_per_s, bytes / hbm_bytes_per_s)`` (the bytes it reads and
    writes); a copy takes its bytes over the rate of its direction, each direction on its own copy
    engine; a copy to or from host memory that is not pinned runs at ``pageable`` times that rate
    and the host waits for it (as CUDA stages it). The ``*_s`` fields are host seconds per call,
    added to the host's virtual clock.
    """

    flops_per_s: float
    """Peak FLOP/s a matmul reaches (dense, the training dtype)."""
    hbm_bytes_per_s: float
    """Device memory bytes per second, reads and writes counted together."""
    d2h_bytes_per_s: float
    """Device to pinned host memory, bytes per second (one copy engine)."""
    h2d_bytes_per_s: float
    """Pinned host memory to device, bytes per second (the other copy engine)."""
    memory_bytes: int = 80 * 10**9
    """Device memory the process may hold (``measure.device_limit`` on the model): an H100's 80 GB."""
    pageable: float = 1 / 3
    """The fraction of the copy rate reached with host memory that is not pinned (an estimate)."""
    launch_s: float = 5e-6
    """Host seconds to launch one op (eager dispatch and kernel launch; an estimate, not measured here)."""
    copy_issue_s: float = 38e-6
    """Host seconds to queue a copy on a side stream through torch (H100 host, 2026-11-25, device/copies.py)."""
    event_s: float = 6.5e-6
    """Host seconds to record an event (H100 host, 2026-11-25: a new event's first record)."""
    poll_s: float = 1e-6
    """Host seconds of one event or stream query (an estimate: it lets a polling loop advance)."""
    pack_s: float = 20e-6
    """Host seconds of one save's pack hook (issue 63: tens of microseconds a save on an H200 host)."""
    unpack_s: float = 20e-6
    """Host seconds of one unpack hook (taken as pack's until measured)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            positive = f.name.endswith("_per_s")
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or (positive and v == 0):
                raise ValueError(f"Rates.{f.name} = {v!r}: must be a finite number "
                                 f"{'> 0' if positive else '>= 0'}")
        if not 0 < self.pageable <= 1:
            raise ValueError(f"Rates.pageable = {self.pageable!r}: must be in (0, 1]")


H100 = Rates(
    # ~400 TFLOP/s: the effective dense bf16 rate of an 8B-ish model's matmuls on the bench's H100
    # (the datasheet's 989 is never reached by training shapes).
    flops_per_s=400e12,
    # Not measured: the datasheet's 3.35 TB/s scaled by what the H200 reached against its
    # datasheet (4.3 of 4.8 TB/s). A forward of an 8B-ish model produced activations at
    # 200-330 GB/s there, four to six times the copy rate below: the model's check.
    hbm_bytes_per_s=3.0e12,
    # 54.7 GB/s device to pinned host (H100, 2026-11-24); host to device taken as the same.
    d2h_bytes_per_s=54.7e9,
    h2d_bytes_per_s=54.7e9,
)
"""An H100 SXM as the bench saw it."""

H200 = Rates(
    # 788 TFLOP/s: a bf16 matmul on random data (H200, 2026-11-28).
    flops_per_s=788e12,
    # ~4.3 TB/s: a device-to-device copy, reads and writes counted (H200).
    hbm_bytes_per_s=4.3e12,
    # 54.5 GB/s device to pinned host (H200, 2026-11-28); host to device taken as the same.
    d2h_bytes_per_s=54.5e9,
    h2d_bytes_per_s=54.5e9,
    memory_bytes=141 * 10**9,  # the datasheet's 141 GB
)
"""An H200 as the bench saw it."""
