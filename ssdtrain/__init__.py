"""ssdtrain: offload the activations PyTorch saves for backward to NVMe, and bring them back
ahead of need.

Importing this package has no side effects: it initialises no CUDA, patches nothing and
configures no logging.
"""

from ssdtrain.config import OffloadConfig
from ssdtrain.offloader import Offloader, no_offload, offload
from ssdtrain.stats import OffloadStats
from ssdtrain.store.base import ChecksumError, StorageError

__all__ = [
    "ChecksumError",
    "OffloadConfig",
    "OffloadStats",
    "Offloader",
    "StorageError",
    "no_offload",
    "offload",
]

__version__ = "0.1.0"
