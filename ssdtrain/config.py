"""Settings of an :class:`~ssdtrain.Offloader`, validated once, before any tensor is touched.

A few I/O knobs that an operator tunes per machine take their defaults from ``SSDTRAIN_*``
environment variables (see the README's settings table); a value passed explicitly always wins.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["OffloadConfig", "parse_bytes"]

BACKENDS = ("auto", "posix", "kvikio", "memory")
ON_ERROR = ("raise", "keep")
WHEN_FULL = ("wait", "keep")

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | str, *, name: str = "size") -> int:
    """Turns ``1048576``, ``"1MiB"``, ``"64 MB"`` or ``"2GiB"`` into a number of bytes.

    Raises:
        ValueError: naming ``name`` when the value is not a non-negative size.
    """
    if isinstance(value, bool):
        raise ValueError(f"{name}={value!r} is not a size; give bytes as an int or a string like '64MiB'")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{name}={value} is negative; give a size >= 0 bytes")
        return value
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m and m.group(2).lower() in _UNITS:
            return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    raise ValueError(
        f"{name}={value!r} is not a size; give bytes as an int or a string like '64MiB' "
        f"(units: {', '.join(u for u in _UNITS if u)})"
    )


def _env(name: str, default: Any) -> Any:
    return os.environ.get(name, default)


def _env_bool(name: str) -> bool | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip().lower() in ("", "auto"):
        return None
    if raw.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if raw.strip().lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"environment variable {name}={raw!r} must be one of on, off, auto")


def _default_io_threads() -> int:
    return min(4, max(2, os.cpu_count() or 2))


def _default_paths() -> tuple[str, ...]:
    raw = os.environ.get("SSDTRAIN_PATH")
    if raw:
        return tuple(p for p in raw.split(os.pathsep) if p)
    return (tempfile.gettempdir(),)


@dataclass(frozen=True, kw_only=True)
class OffloadConfig:
    """What to offload, where to, and how hard to push the drive.

    Every field is validated in ``__post_init__``; an invalid value raises ``ValueError`` naming
    the field, the value and what is allowed. Sizes accept ints (bytes) or strings like ``"64MiB"``.
    """

    path: str | tuple[str, ...] = field(default_factory=_default_paths)
    """Directory (or directories, striped) for the arena files. Default: ``$SSDTRAIN_PATH``
    (``os.pathsep``-separated), else the system temporary directory."""
    backend: str = field(default_factory=lambda: _env("SSDTRAIN_BACKEND", "auto"))
    """``"posix"`` (pwrite/preadv, O_DIRECT where possible), ``"kvikio"`` (cuFile/GPUDirect
    Storage), ``"memory"`` (host RAM), or ``"auto"``: kvikio for CUDA when usable, else posix."""
    min_bytes: int = 1 << 20
    """Tensors smaller than this stay in memory (0: every eligible tensor is offloaded)."""
    keep_last_layers: int = 0
    """Keep the tensors saved in the last N blocks in memory (backward needs them first)."""
    layers: str | None = None
    """Dotted attribute name of the model's ``nn.ModuleList`` of blocks (e.g. ``"transformer.h"``);
    ``None`` finds the largest ``ModuleList`` of same-typed modules."""
    prefetch_layers: int = 2
    """In backward, read ahead this many blocks below the one running."""
    prefetch_bytes: int = 256 << 20
    """... and at most this many bytes ahead. The window starts smaller and doubles each time
    backward has to wait for a read, so it grows only as far as the drive needs."""
    max_inflight_bytes: int = 1 << 30
    """Cap on bytes waiting to be written; see ``when_full``."""
    when_full: str = "wait"
    """When ``max_inflight_bytes`` is reached: ``"wait"`` for the drive, or ``"keep"`` the tensor
    in memory."""
    on_error: str = "raise"
    """A failed write: ``"raise"`` at the next step boundary, or ``"keep"`` the tensor in memory
    (with one warning). A failed read always raises: garbage is never returned."""
    verify: bool = False
    """Checksum (CRC32) each extent when written and check it when read back."""
    io_threads: int = field(default_factory=lambda: int(_env("SSDTRAIN_IO_THREADS", _default_io_threads())))
    """I/O worker threads per path (and as many again for reads). Default: one per core, 2 to 4:
    on a small machine every extra thread competes with compute for the same cores."""
    direct_io: bool | None = field(default_factory=lambda: _env_bool("SSDTRAIN_DIRECT_IO"))
    """O_DIRECT for the posix backend: ``True`` (required), ``False``, or ``None`` (when the
    filesystem supports it)."""
    chunk_bytes: int = field(default_factory=lambda: parse_bytes(_env("SSDTRAIN_CHUNK_BYTES", 8 << 20)))
    """Size of one I/O request (syscall); larger tensors are split into requests of this size (one
    thread moves them in order on O_DIRECT host memory, several threads when they copy)."""
    rated_tbw: float | None = None
    """The drive's rated endurance in terabytes written; enables the wear-out warning."""
    endurance_horizon_days: float = 365.0
    """Warn once if, at the current write rate, the rated endurance would be used up sooner."""
    create_path: bool = True
    """Create a missing ``path`` directory (with its parents); ``False`` refuses it instead."""

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        paths = self.path
        if isinstance(paths, (str, os.PathLike)):
            paths = (paths,)
        if not isinstance(paths, (list, tuple)) or not paths:
            raise ValueError(f"path={self.path!r} must be a directory or a non-empty list of directories")
        clean = []
        for p in paths:
            if not isinstance(p, (str, os.PathLike)) or not os.fspath(p):
                raise ValueError(f"path={self.path!r}: {p!r} is not a directory name")
            clean.append(os.path.abspath(os.path.expanduser(os.fspath(p))))
        if len(set(clean)) != len(clean):
            raise ValueError(f"path={self.path!r} names the same directory twice; list each drive once")
        put("path", tuple(clean))

        _choice("backend", self.backend, BACKENDS)
        _choice("on_error", self.on_error, ON_ERROR)
        _choice("when_full", self.when_full, WHEN_FULL)
        for name in ("min_bytes", "prefetch_bytes", "max_inflight_bytes", "chunk_bytes"):
            put(name, parse_bytes(getattr(self, name), name=name))
        for name in ("keep_last_layers", "prefetch_layers"):
            _int_at_least(name, getattr(self, name), 0)
        _int_at_least("io_threads", self.io_threads, 1)
        if self.chunk_bytes < 4096 or self.chunk_bytes % 4096:
            raise ValueError(f"chunk_bytes={self.chunk_bytes} must be a positive multiple of 4096 (e.g. '8MiB')")
        if self.max_inflight_bytes == 0:
            raise ValueError("max_inflight_bytes=0 would keep every write waiting; give a size > 0 (e.g. '1GiB')")
        for name in ("verify", "create_path"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False")
        if self.direct_io not in (None, True, False):
            raise ValueError(f"direct_io={self.direct_io!r} must be True, False or None (auto)")
        if self.layers is not None and (not isinstance(self.layers, str) or not self.layers):
            raise ValueError(f"layers={self.layers!r} must be a dotted attribute name like 'transformer.h', or None")
        if self.rated_tbw is not None:
            _positive_number("rated_tbw", self.rated_tbw)
        _positive_number("endurance_horizon_days", self.endurance_horizon_days)

    @property
    def paths(self) -> tuple[str, ...]:
        """``path`` as a tuple, always."""
        return self.path  # type: ignore[return-value]

    def replace(self, **overrides: Any) -> OffloadConfig:
        """A copy with some fields changed (validated again)."""
        check_keys(overrides)
        return dataclasses.replace(self, **overrides)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> OffloadConfig:
        """Builds a config from a mapping (a JSON section, parsed flags); unknown keys are refused."""
        check_keys(values)
        return cls(**dict(values))

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def field_names() -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(OffloadConfig))


def check_keys(values: Mapping[str, Any], *, where: str = "OffloadConfig") -> None:
    """Raises ``ValueError`` naming every key that is not a field of :class:`OffloadConfig`."""
    unknown = sorted(set(values) - set(field_names()))
    if unknown:
        raise ValueError(
            f"unknown {where} key(s): {', '.join(map(repr, unknown))}; "
            f"allowed: {', '.join(field_names())}"
        )


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(map(repr, allowed))}")


def _int_at_least(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}={value!r} must be an integer >= {low}")


def _positive_number(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name}={value!r} must be a number > 0")
