"""ssdtrain: offload the activations PyTorch saves for backward to NVMe, and bring them back
ahead of need.

Importing this package has no side effects: it initialises no CUDA, patches nothing and
configures no logging. Its names load on first use, so ``ssdtrain plan`` starts without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = [
    "ChecksumError",
    "OffloadConfig",
    "OffloadStats",
    "Offloader",
    "SAVE_IN_MEMORY",
    "StorageError",
    "no_offload",
    "offload",
    "sac_context",
]

__version__ = "0.1.0"

_WHERE = {
    "OffloadConfig": "ssdtrain.config",
    "Offloader": "ssdtrain.engine.offloader",
    "offload": "ssdtrain.switch",
    "no_offload": "ssdtrain.engine.keep",
    "OffloadStats": "ssdtrain.engine.stats",
    "SAVE_IN_MEMORY": "ssdtrain.sac",
    "sac_context": "ssdtrain.sac",
    "StorageError": "ssdtrain.store.base",
    "ChecksumError": "ssdtrain.store.base",
}

if TYPE_CHECKING:
    from ssdtrain.config import OffloadConfig
    from ssdtrain.engine.keep import no_offload
    from ssdtrain.engine.offloader import Offloader
    from ssdtrain.sac import SAVE_IN_MEMORY, sac_context
    from ssdtrain.switch import offload
    from ssdtrain.engine.stats import OffloadStats
    from ssdtrain.store.base import ChecksumError, StorageError


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ssdtrain' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
