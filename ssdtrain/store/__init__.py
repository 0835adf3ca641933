"""Storage backends: where offloaded bytes live. See :mod:`ssdtrain.store.base`."""

from __future__ import annotations

import functools
import importlib.util
import logging
import weakref

from ssdtrain.config import OffloadConfig
from ssdtrain.store.base import ALIGN, Backend, ChecksumError, Extent, StorageError, on_drive

__all__ = ["ALIGN", "Backend", "ChecksumError", "Extent", "StorageError", "on_drive", "make_backend", "choose_backend",
           "backend_choice"]

log = logging.getLogger(__name__)


# Note [auto picks kvikio only with GDS]
# kvikio pays off only where GPUDirect Storage really runs: without it kvikio's compatibility
# mode copies through a blocking stream that serialises with compute (Note [kvikio compat mode
# serialises with compute] in kvikio_backend.py), and the posix backend does the same staging on
# a non-blocking stream of its own. So ``auto`` means kvikio only when CUDA is available, kvikio
# imports (25.12 or newer), the nvidia_fs driver is loaded and kvikio is not in compatibility
# mode; and, once its arenas are open, only if every path is on a file system that GDS serves.
# Anything else -- including an import or open failure of kvikio -- is posix, and the reason
# goes to the log and into ``describe()`` (``stats().backend``).
_KVIKIO_BROKEN = ("kvikio is not usable", "kvikio could not start")


def backend_choice(cfg: OffloadConfig) -> tuple[str, str]:
    """``(backend, why)``: what ``cfg.backend`` means on this machine and the reason.

    Only ``auto`` is resolved; for an explicit backend the reason is ``"asked for"``. Never
    initialises CUDA without a GPU (``torch.cuda.is_available`` does not create a context).
    """
    if cfg.backend != "auto":
        return cfg.backend, "asked for"
    import torch

    if not torch.cuda.is_available():
        return "posix", "no CUDA device"
    if importlib.util.find_spec("kvikio") is None:
        return "posix", "kvikio is not installed"
    try:
        from ssdtrain.store.kvikio_backend import gds_status
    except ImportError as e:
        return "posix", f"kvikio is not usable: {e}"
    gds, why = gds_status()
    if not gds:
        return "posix", f"no GPUDirect Storage: {why}"
    return "kvikio", why


def choose_backend(cfg: OffloadConfig) -> str:
    """What ``backend="auto"`` means here: kvikio where GPUDirect Storage is in use, else posix
    (Note [auto picks kvikio only with GDS]); other values are returned as they are."""
    return backend_choice(cfg)[0]


def _describe_with_reason(ref: weakref.ref, why: str) -> str:
    backend = ref()
    return "?" if backend is None else f"{type(backend).describe(backend)} [auto: {why}]"


def _explain(backend: Backend, why: str) -> Backend:
    """Makes ``backend.describe()`` end with why ``auto`` chose it (no reference cycle)."""
    backend.describe = functools.partial(_describe_with_reason, weakref.ref(backend), why)
    return backend


def make_backend(cfg: OffloadConfig) -> Backend:
    """The backend ``cfg`` asks for, opened on its paths (``auto`` resolved by :func:`backend_choice`).

    Raises:
        ImportError: ``backend="kvikio"`` and kvikio cannot be imported (the message says why).
        ValueError: a path cannot be used.
    """
    name, why = backend_choice(cfg)
    backend: Backend | None = None
    if name == "kvikio":
        from ssdtrain.store.kvikio_backend import KvikioBackend

        if cfg.backend != "auto":
            backend = KvikioBackend(cfg)
        else:
            try:
                backend = KvikioBackend(cfg)
            except (RuntimeError, OSError, ValueError) as e:  # a real path problem: posix says so too
                name, why = "posix", f"kvikio could not start ({e})"
            else:
                if not backend.gds:  # a path GDS does not serve
                    name, why = "posix", f"no GPUDirect Storage: {backend.why}"
                    backend.close()
                    backend = None
    if backend is None:
        if name == "posix":
            from ssdtrain.store.posix import PosixBackend

            backend = PosixBackend(cfg)
        elif name == "memory":
            from ssdtrain.store.memory import MemoryBackend

            backend = MemoryBackend(cfg)
        else:
            raise ValueError(f"backend={name!r} is not one of 'auto', 'posix', 'kvikio', 'memory'")
    if cfg.backend == "auto":
        _explain(backend, why)
        if why.startswith(_KVIKIO_BROKEN):  # installed for GDS, and broken: worth more than INFO
            log.warning("ssdtrain: kvikio is installed but cannot be used; offloading through posix (%s)", why)
    log.info("ssdtrain: backend %s", backend.describe())
    return backend
