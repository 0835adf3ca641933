"""Test-only: run Megatron-Core's pipeline schedules on a CPU-only PyTorch.

Megatron-Core 0.16 hard-codes CUDA in a few places on the paths the tests use: buffers made with
``device="cuda"`` or ``device=torch.cuda.current_device()``, ``torch.cuda.synchronize()`` after
point-to-point transfers, and CUDA generators in the RNG tracker. ``cpu_megatron()`` maps CUDA
devices to the CPU with a ``TorchFunctionMode`` and stubs the few ``torch.cuda`` calls; the RNG
tracker is avoided with ``initialize_rng_tracker(inference_rng_tracker=True)`` by the caller.

This lives in ``tests/`` on purpose: ``ssdtrain.integrations.megatron`` itself must work without
any of it (it never touches a device).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")


def _to_cpu(device: Any) -> Any:
    if isinstance(device, int):  # an int device means cuda:<int> to the factory functions
        return _CPU
    if isinstance(device, str) and device.startswith("cuda"):
        return _CPU
    if isinstance(device, torch.device) and device.type == "cuda":
        return _CPU
    return device


class _CudaToCpu(TorchFunctionMode):
    """Rewrites ``device=`` arguments naming CUDA to the CPU; ``Tensor.cuda()`` is the identity."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if "device" in kwargs:
            kwargs["device"] = _to_cpu(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1 and not isinstance(args[1], torch.Tensor):
            args = (args[0], _to_cpu(args[1]), *args[2:])
        return func(*args, **kwargs)


@contextlib.contextmanager
def cpu_megatron() -> Iterator[None]:
    """Lets Megatron-Core's schedules, GPTModel (local spec) and p2p code run on the CPU."""
    from megatron.core.tensor_parallel import random as mrandom

    saved = {name: getattr(torch.cuda, name) for name in ("current_device", "synchronize")}
    torch.cuda.current_device = lambda: 0  # type: ignore[assignment]
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
    # Activation recompute saves "the GPU's" RNG state and restores it to replay dropout: here
    # the RNG that dropout draws from is the CPU's.
    rng = (mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state)
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    try:
        with _CudaToCpu():
            yield
    finally:
        for name, fn in saved.items():
            setattr(torch.cuda, name, fn)
        mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state = rng
