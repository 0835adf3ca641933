"""torch's switch for selective activation checkpointing (SAC), as the engine sees it: whether
this torch has ``respect_saved_tensors_hooks`` (:func:`has_switch`), and a warning for a user's
own SAC that runs inside ``with off:`` without it (:func:`warn_unswitched`). ``ssdtrain/sac.py``
builds :func:`~ssdtrain.sac_context` on them.
"""

from __future__ import annotations

import inspect
import sys
import warnings
from typing import Any

import torch.utils.checkpoint as torch_checkpoint

__all__ = ["has_switch", "warn_unswitched"]


def has_switch() -> bool:
    """Whether this torch's ``checkpoint`` takes ``respect_saved_tensors_hooks`` (torch >= 2.14)."""
    return "respect_saved_tensors_hooks" in inspect.signature(torch_checkpoint.checkpoint).parameters


# Note [SAC without the switch is told]
# A user's own SAC (``context_fn=create_selective_checkpoint_contexts(policy)``) inside ``with
# off:`` keeps its saves out of the offloader's reach unless ``checkpoint`` gets
# ``respect_saved_tensors_hooks=True`` (torch >= 2.14). torch's caching mode looks up the hooks
# around it for each op it keeps, and asks each pack hook whether it is checkpoint's own
# (``_checkpoint_internal``); the offloader's pack hook answers that question through
# :func:`warn_unswitched`, which looks a few frames up for a caching mode whose flag is unset,
# and then warns once per offloader with the fix. Nothing is changed: it only looks.
def warn_unswitched(offloader: Any) -> None:
    """Warns (once per ``offloader``) if torch's SAC caching mode is asking for the hooks with its
    ``respect_saved_tensors_hooks`` unset: its saves bypass ssdtrain."""
    if offloader._sac_told:
        return
    caching = getattr(torch_checkpoint, "_CachingTorchDispatchMode", None)
    frame = sys._getframe(2)
    for _ in range(3):
        if frame is None or caching is None:
            return
        mode = frame.f_locals.get("self")
        if isinstance(mode, caching):
            if getattr(mode, "respect_saved_tensors_hooks", False) is None:
                offloader._sac_told = True
                warnings.warn(
                    "ssdtrain: selective activation checkpointing runs inside `with off:` without "
                    "respect_saved_tensors_hooks, so what it saves stays in memory, out of ssdtrain's reach. "
                    "Pass respect_saved_tensors_hooks=True to torch.utils.checkpoint.checkpoint, or use "
                    "context_fn=ssdtrain.sac_context(policy, off), which does it for you.",
                    UserWarning, stacklevel=5)
            return
        frame = frame.f_back
