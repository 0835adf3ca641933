"""Settings of an :class:`~ssdtrain.Offloader`, validated once, before any tensor is touched.

A few I/O knobs that an operator tunes per machine take their defaults from ``SSDTRAIN_*``
environment variables (see the README's settings table); a value passed explicitly always wins.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

__all__ = ["OffloadConfig", "parse_bytes", "env_flag"]

BACKENDS = ("auto", "posix", "kvikio", "memory")
ON_ERROR = ("raise", "keep")
WHEN_FULL = ("wait", "keep")

# Upper bounds: far above any real machine, low enough that a typo (an extra "000", a unit
# mistaken for another) is refused here instead of failing later as a hang or an OverflowError.
MAX_BYTES = 1 << 50
"""Largest size setting: 1 PiB."""
MAX_CHUNK_BYTES = 1 << 30
"""Largest ``chunk_bytes``: 1 GiB (one syscall; its staging buffer is per I/O thread)."""
MAX_IO_THREADS = 64
MAX_PREFETCH_LAYERS = 1024
MAX_KEEP_LAST_LAYERS = 1 << 20
MAX_RATED_TBW = 1e6
"""1e6 TB (an exabyte) written: 10x beyond the most enduring drive sold."""
MAX_HORIZON_DAYS = 36500
"""A hundred years."""
NAME_MAX = 255
"""Bytes in one path component (Linux, every common filesystem)."""
PATH_MAX = 4096
"""Bytes in a whole path, with its terminating NUL (Linux)."""
_MAX_SIZE_TEXT = 1000  # characters of a size string parsed at all (1 PiB needs 16 digits)

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")
_INT_RE = re.compile(r"^\s*[0-9]{1,18}\s*$")
_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


def _show(value: Any) -> str:
    """``repr(value)``, cut short: a 400-digit string or a 10**5000 must not fill the message."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 200:
        return f"<an integer of {value.bit_length()} bits>"
    r = repr(value)
    return r if len(r) <= 80 else f"{r[:60]}... ({len(r)} characters)"


def _human(n: int) -> str:
    for unit, size in (("PiB", 1 << 50), ("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} bytes"


def parse_bytes(value: int | str, *, name: str = "size", maximum: int = MAX_BYTES) -> int:
    """Turns ``1048576``, ``"1MiB"``, ``"64 MB"`` or ``"2GiB"`` into a number of bytes.

    Raises:
        ValueError: naming ``name`` when the value is not a size from 0 to ``maximum`` bytes
            (default 1 PiB).
    """
    if isinstance(value, bool):
        raise ValueError(f"{name}={value!r} is not a size; give bytes as an int or a string like '64MiB'")
    n: int | Decimal | None = None
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{name}={_show(value)} is negative; give a size >= 0 bytes")
        n = value
    elif isinstance(value, str) and len(value) <= _MAX_SIZE_TEXT:
        m = _SIZE_RE.match(value)
        if m and m.group(2).lower() in _UNITS:
            # Decimal, not float: a long digit string is exact or huge, never inf (OverflowError).
            n = Decimal(m.group(1)) * _UNITS[m.group(2).lower()]
    if n is None:
        raise ValueError(
            f"{name}={_show(value)} is not a size; give bytes as an int or a string like '64MiB' "
            f"(units: {', '.join(u for u in _UNITS if u)})"
        )
    if n > maximum:
        raise ValueError(f"{name}={_show(value)} is more than {_human(maximum)}; give a size up to {maximum} bytes")
    return int(n)


def env_flag(name: str) -> bool:
    """An on/off environment variable: unset or empty is off; ``1/true/yes/on`` and
    ``0/false/no/off`` (any case); anything else raises ``ValueError`` naming the variable."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return False
    value = raw.strip().lower()
    if value in _ON or value in _OFF:
        return value in _ON
    raise ValueError(f"environment variable {name}={_show(raw)} must be one of 1, 0, on, off, true, false, yes, no")


def _from_env(name: str, parse: Callable[[str], Any], default: Callable[[], Any]) -> Any:
    """``parse(raw)`` of an environment variable (``default()`` when unset or empty); a refused
    value raises ``ValueError`` naming the variable (``parse`` words its message ``name=...``)."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default()
    try:
        return parse(raw)
    except ValueError as e:
        raise ValueError(f"environment variable {e}") from None


def _env_bool(name: str) -> bool | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip().lower() in ("", "auto"):
        return None
    if raw.strip().lower() in _ON:
        return True
    if raw.strip().lower() in _OFF:
        return False
    raise ValueError(f"environment variable {name}={_show(raw)} must be one of on, off, auto")


def _env_int(name: str, low: int, high: int, default: Callable[[], int]) -> int:
    def parse(raw: str) -> int:
        if not _INT_RE.match(raw) or not low <= int(raw) <= high:
            raise ValueError(f"{name}={_show(raw)} must be an integer from {low} to {high}")
        return int(raw)
    return _from_env(name, parse, default)


def _env_chunk() -> int:
    name = "SSDTRAIN_CHUNK_BYTES"
    return _from_env(name, lambda raw: _chunk(name, raw), lambda: 8 << 20)


def _env_backend() -> str:
    name = "SSDTRAIN_BACKEND"
    return _from_env(name, lambda raw: _choice(name, raw.strip(), BACKENDS), lambda: "auto")


def _env_host_bytes() -> int | None:
    name = "SSDTRAIN_HOST_BYTES"
    return _from_env(name, lambda raw: None if raw.strip().lower() == "auto" else parse_bytes(raw, name=name),
                     lambda: None)


def _default_io_threads() -> int:
    return min(4, max(2, os.cpu_count() or 2))


def _default_paths() -> tuple[str, ...]:
    raw = os.environ.get("SSDTRAIN_PATH")
    if not raw:
        return (tempfile.gettempdir(),)
    paths = tuple(p for p in raw.split(os.pathsep) if p)
    if not paths:
        raise ValueError(f"environment variable SSDTRAIN_PATH={_show(raw)} names no directory; "
                         f"give directories separated by {os.pathsep!r}, or unset it")
    for p in paths:
        try:
            _dir_name("SSDTRAIN_PATH", raw, p)
        except ValueError as e:
            raise ValueError(f"environment variable {e}") from None
    return paths


@dataclass(frozen=True, kw_only=True)
class OffloadConfig:
    """What to offload, where to, and how hard to push the drive.

    Every field is validated in ``__post_init__``; an invalid value raises ``ValueError`` naming
    the field, the value and what is allowed. Sizes accept ints (bytes) or strings like ``"64MiB"``.
    """

    path: str | tuple[str, ...] = field(default_factory=_default_paths)
    """Directory (or directories, striped) for the arena files. Default: ``$SSDTRAIN_PATH``
    (``os.pathsep``-separated), else the system temporary directory. Each at most 4095 bytes
    long, 255 per component, with no NUL byte. Missing directories are created 0700."""
    backend: str = field(default_factory=_env_backend)
    """``"posix"`` (pwrite/preadv, O_DIRECT where possible), ``"kvikio"`` (cuFile/GPUDirect
    Storage), ``"memory"`` (host RAM), or ``"auto"``: kvikio where GPUDirect Storage is really
    in use (not kvikio's compatibility mode), else posix; ``stats().backend`` says why."""
    min_bytes: int = 1 << 20
    """Tensors smaller than this stay in memory (0: every eligible tensor is offloaded). Every
    size setting is at most 1 PiB."""
    keep_last_layers: int = 0
    """Keep the tensors saved in the last N blocks in memory (backward needs them first); at
    most 2**20."""
    layers: str | None = None
    """Dotted attribute name of the model's ``nn.ModuleList`` of blocks (e.g. ``"transformer.h"``);
    ``None`` finds the largest ``ModuleList`` of same-typed modules."""
    prefetch_layers: int | None = None
    """In backward, read ahead at most this many blocks below the one running (0 to 1024);
    ``None``: as far as the read-ahead window allows."""
    prefetch_bytes: int = 256 << 20
    """Cap of the read-ahead window that the drive's speed sizes: it starts at 16 MiB and doubles
    each time backward had to wait for reads, so it grows only as far as the drive needs.
    Beyond it, reads also fill the memory that backward has freed, never above the saved bytes
    resident when backward began (the step's peak)."""
    max_inflight_bytes: int = 1 << 30
    """Cap on bytes waiting to be written; see ``when_full``."""
    when_full: str = "keep"
    """When ``max_inflight_bytes`` is reached: ``"keep"`` the tensor in memory (the step never
    waits for the drive; a step also writes only what the drive can bring back in time, learned
    from backward's waits: ``stats().budget_kept_bytes``), or ``"wait"`` for the drive (memory
    first: everything eligible is written, and the waits show in
    ``stats().backpressure_stall_seconds`` and ``read_stall_seconds``)."""
    late_writes: bool = False
    """With ``when_full="keep"``: also write a step's saves whose write is predicted to end after
    the step's peak (the end of its forward). Such writes lower no peak of saved activations
    (``stats().peak_kept_bytes`` counts what is kept instead) but cost drive time and wear; turn
    them on only where the step's memory peaks later, in backward (large gradients, say).
    Micro-batches (``off.microbatch``) always write them: a pipeline stage's peak comes later."""
    on_error: str = "raise"
    """A failed write: ``"raise"`` at the next step boundary, or ``"keep"`` the tensor in memory
    (with one warning). A failed read always raises: garbage is never returned."""
    verify: bool = False
    """Checksum (CRC32) each extent when written and check it when read back."""
    io_threads: int = field(default_factory=lambda: _env_int("SSDTRAIN_IO_THREADS", 1, MAX_IO_THREADS,
                                                              _default_io_threads))
    """I/O worker threads per path (and as many again for reads), 1 to 64. Default: one per core,
    2 to 4: on a small machine every extra thread competes with compute for the same cores."""
    direct_io: bool | None = field(default_factory=lambda: _env_bool("SSDTRAIN_DIRECT_IO"))
    """O_DIRECT for the posix backend: ``True`` (required), ``False``, or ``None`` (when the
    filesystem supports it). Exactly these three: ``0`` or ``"yes"`` are refused."""
    chunk_bytes: int = field(default_factory=_env_chunk)
    """Size of one I/O request (syscall), a multiple of 4 KiB up to 1 GiB; larger tensors are
    split into requests of this size (one thread moves them in order on O_DIRECT host memory,
    several threads when they copy)."""
    rated_tbw: float | None = None
    """The drive's rated endurance in terabytes written (finite, > 0, at most 1e6); enables the
    wear-out warning."""
    endurance_horizon_days: float = 365.0
    """Warn once if, at the current write rate, the rated endurance would be used up sooner
    (finite, > 0, at most 36500 days)."""
    create_path: bool = True
    """Create a missing ``path`` directory (with its parents); ``False`` refuses it instead."""
    host_bytes: int | str | None = field(default_factory=_env_host_bytes)
    """Pinned host memory in front of the drives, for CUDA tensors (the host tier): a save leaves
    the GPU when its copy to this memory is done, the drives take what it cannot hold. ``None``
    (``SSDTRAIN_HOST_BYTES``, or ``auto``): a quarter of the RAM available when the first CUDA
    tensor is offloaded, divided among the local ranks (``LOCAL_WORLD_SIZE``), and no more than
    the locked-memory limit allows; ``0``: off (CUDA tensors go to the drives through a small
    staging buffer). Pinned once, in slabs, as it fills. CPU tensors never use it."""
    keep_modules: tuple[str, ...] = ()
    """Dotted names of modules (``model.named_modules()``) whose saves stay in memory, e.g.
    ``("lm_head",)``; ``Offloader(keep_modules=[...])`` also takes the modules themselves."""

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        paths = self.path
        if isinstance(paths, (str, os.PathLike)):
            paths = (paths,)
        if not isinstance(paths, (list, tuple)) or not paths:
            raise ValueError(f"path={_show(self.path)} must be a directory or a non-empty list of directories")
        clean = [_dir_name("path", self.path, p) for p in paths]
        if len(set(clean)) != len(clean):
            raise ValueError(f"path={self.path!r} names the same directory twice; list each drive once")
        put("path", tuple(clean))

        _choice("backend", self.backend, BACKENDS)
        _choice("on_error", self.on_error, ON_ERROR)
        _choice("when_full", self.when_full, WHEN_FULL)
        for name in ("min_bytes", "prefetch_bytes", "max_inflight_bytes"):
            put(name, parse_bytes(getattr(self, name), name=name))
        if self.host_bytes is not None and not (isinstance(self.host_bytes, str)
                                                and self.host_bytes.strip().lower() == "auto"):
            put("host_bytes", parse_bytes(self.host_bytes, name="host_bytes"))
        else:
            put("host_bytes", None)
        put("chunk_bytes", _chunk("chunk_bytes", self.chunk_bytes))
        _int_in("keep_last_layers", self.keep_last_layers, 0, MAX_KEEP_LAST_LAYERS)
        if self.prefetch_layers is not None:
            _int_in("prefetch_layers", self.prefetch_layers, 0, MAX_PREFETCH_LAYERS)
        if isinstance(self.keep_modules, str):
            put("keep_modules", (self.keep_modules,))
        if not isinstance(self.keep_modules, (list, tuple)) or not all(
                isinstance(m, str) and m for m in self.keep_modules):
            raise ValueError(f"keep_modules={self.keep_modules!r} must be a list of dotted module names "
                             "(e.g. ['lm_head']); pass the modules themselves to Offloader(keep_modules=[...])")
        put("keep_modules", tuple(self.keep_modules))
        _int_in("io_threads", self.io_threads, 1, MAX_IO_THREADS)
        if self.max_inflight_bytes == 0:
            raise ValueError("max_inflight_bytes=0 would keep every write waiting; give a size > 0 (e.g. '1GiB')")
        for name in ("verify", "create_path", "late_writes"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={_show(getattr(self, name))} must be True or False")
        # Identity, not equality: 0 == False and 1.0 == True, but neither says what was meant.
        if not (self.direct_io is None or self.direct_io is True or self.direct_io is False):
            raise ValueError(f"direct_io={_show(self.direct_io)} must be True, False or None (auto)")
        if self.layers is not None and (not isinstance(self.layers, str) or not self.layers):
            raise ValueError(f"layers={_show(self.layers)} must be a dotted attribute name like 'transformer.h', "
                             "or None")
        if self.rated_tbw is not None:
            _number_in("rated_tbw", self.rated_tbw, MAX_RATED_TBW)
        _number_in("endurance_horizon_days", self.endurance_horizon_days, MAX_HORIZON_DAYS)

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


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"{name}={_show(value)} is not one of {', '.join(map(repr, allowed))}")
    return value


def _int_in(name: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name}={_show(value)} must be an integer from {low} to {high}")
    return value


def _number_in(name: str, value: Any, high: float) -> None:
    # Comparisons, not float(): NaN and inf fail them, and a huge int never overflows.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= high:
        raise ValueError(f"{name}={_show(value)} must be a finite number > 0 and at most {high:g}")


def _chunk(name: str, value: Any) -> int:
    n = parse_bytes(value, name=name, maximum=MAX_CHUNK_BYTES)
    if n < 4096 or n % 4096:
        raise ValueError(f"{name}={_show(value)} must be a positive multiple of 4096 (e.g. '8MiB')")
    return n


def _dir_name(name: str, whole: Any, p: Any) -> str:
    """``p`` as an absolute directory name, checked before anything is created: refused (naming
    ``name``) when it has a NUL byte, a component over 255 bytes or 4095 bytes in all."""
    where = f"{name}={_show(whole)}" + ("" if whole is p else f": {_show(p)}")
    if not isinstance(p, (str, os.PathLike)) or not isinstance(os.fspath(p), str) or not os.fspath(p):
        raise ValueError(f"{where} is not a directory name")
    text = os.fspath(p)
    if "\0" in text:
        raise ValueError(f"{where} contains a NUL byte; give a directory name without one")
    full = os.path.abspath(os.path.expanduser(text))
    try:
        raw = os.fsencode(full)
    except UnicodeError as e:
        raise ValueError(f"{where} cannot be encoded as a file name ({e.reason})") from None
    if len(raw) >= PATH_MAX:
        raise ValueError(f"{where}: the directory name is {len(raw)} bytes long; the limit is {PATH_MAX - 1}")
    longest = max(raw.split(b"/"), key=len)
    if len(longest) > NAME_MAX:
        raise ValueError(f"{where}: the component {_show(os.fsdecode(longest))} is {len(longest)} bytes long; "
                         f"the limit is {NAME_MAX}")
    return full
