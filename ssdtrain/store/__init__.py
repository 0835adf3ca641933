"""Storage backends: where offloaded bytes live. See :mod:`ssdtrain.store.base`."""

from __future__ import annotations

import importlib.util
import logging

from ssdtrain.config import OffloadConfig
from ssdtrain.store.base import ALIGN, Backend, ChecksumError, Extent, StorageError

__all__ = ["ALIGN", "Backend", "ChecksumError", "Extent", "StorageError", "make_backend", "choose_backend"]

log = logging.getLogger(__name__)


def choose_backend(cfg: OffloadConfig) -> str:
    """What ``backend="auto"`` means here: kvikio when CUDA and kvikio are usable, else posix."""
    if cfg.backend != "auto":
        return cfg.backend
    import torch

    if importlib.util.find_spec("kvikio") is not None and torch.cuda.is_available():
        return "kvikio"
    return "posix"


def make_backend(cfg: OffloadConfig) -> Backend:
    name = choose_backend(cfg)
    if name == "posix":
        from ssdtrain.store.posix import PosixBackend

        backend: Backend = PosixBackend(cfg)
    elif name == "memory":
        from ssdtrain.store.memory import MemoryBackend

        backend = MemoryBackend(cfg)
    else:
        from ssdtrain.store.kvikio_backend import KvikioBackend

        backend = KvikioBackend(cfg)
    log.info("ssdtrain: backend %s", backend.describe())
    return backend
