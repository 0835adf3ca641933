"""The modelled GPU's compute: a dispatch mode that charges every aten op to the current
modelled stream and counts the device memory ops make.

An op takes ``max(flops / Rates.flops_per_s, bytes / Rates.hbm_bytes_per_s)``: its FLOPs from
``torch.utils.flop_counter``'s formulas (matmuls, convolutions, attention; zero for the rest),
its bytes the device tensors it reads and writes. The host pays ``Rates.launch_s`` per op.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop, sdpa_flop

from ssdtrain.device.model import DEVICE, ModelledGPU, _merge, poison

__all__ = ["ModelledCompute", "op_seconds"]

aten = torch.ops.aten

# The CPU's own attention kernels, with the formulas of the CUDA ones (same leading arguments).
_FLOPS = dict(flop_registry)
for _name, _formula in (("_scaled_dot_product_flash_attention_for_cpu", sdpa_flop),
                        ("_scaled_dot_product_flash_attention_for_cpu_backward", sdpa_backward_flop)):
    _packet = getattr(aten, _name, None)
    if _packet is not None:
        _FLOPS.setdefault(_packet, _formula)

# Allocations without a kernel: their memory is counted and reads as poison until written.
_NO_KERNEL = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default,
              aten.new_empty.default, aten.new_empty_strided.default}


def _tensors(tree) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    _collect(tree, out)
    return out


def _collect(tree, out: list) -> None:
    # An op's arguments hold tensors in lists, tuples and dicts only: a plain walk, cheaper than
    # pytree's general one, which every modelled op paid several times.
    if isinstance(tree, torch.Tensor):
        out.append(tree)
    elif isinstance(tree, (list, tuple)):
        for x in tree:
            _collect(x, out)
    elif isinstance(tree, dict):
        for x in tree.values():
            _collect(x, out)


def _written(func, args, kwargs) -> list[torch.Tensor]:
    out = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            v = args[i] if i < len(args) else kwargs.get(a.name)
            out += _tensors(v)
    return out


def op_seconds(gpu: ModelledGPU, func, args, kwargs, out) -> float:
    """Device seconds of ``func`` on the model: FLOPs at the peak rate or its device bytes at the
    HBM rate, whichever is longer."""
    formula = _FLOPS.get(func._overloadpacket)
    flops = formula(*args, **kwargs, out_val=out) if formula is not None else 0
    nbytes = sum(t.numel() * t.element_size() for t in _tensors((args, kwargs)) + _tensors(out) if gpu.is_device(t))
    r = gpu.rates
    return max(flops / r.flops_per_s, nbytes / r.hbm_bytes_per_s)


class ModelledCompute(TorchDispatchMode):
    """While active, every aten op on device tensors is charged to ``gpu``'s current stream.

    Which ops are device ops: those with a device tensor among their inputs, and factories (no
    tensor input: ``torch.empty``, ``torch.randn``, ...), whose results are device memory
    allocated under the current stream. Ops on host tensors alone run as host code (unmodelled,
    free). A ``copy_`` between device and host memory is :meth:`ModelledGPU.copy`. ``.item()``
    makes the host wait for the stream, as on CUDA.
    """

    def __init__(self, gpu: ModelledGPU) -> None:
        super().__init__()
        self.gpu = gpu

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return run_op(self.gpu, func, args, kwargs or {})


def run_op(gpu: ModelledGPU, func, args, kwargs):
    """Runs one aten op on the model (see :class:`ModelledCompute`)."""
    gpu._check()
    inputs = _tensors((args, kwargs))
    if func is aten.copy_.default:
        kinds = {gpu.kind(args[0]), gpu.kind(args[1])}
        if DEVICE in kinds and len(kinds) == 2:
            non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
            gpu.copy(args[0], args[1], non_blocking=bool(non_blocking))
            return args[0]
    if func.is_view or (inputs and func in (aten.detach.default, aten.alias.default)):
        return func(*args, **kwargs)  # an alias of memory the model already knows: no kernel
    if func._overloadpacket is aten.set_:
        # Re-points a tensor at memory (the engine's byte views of a save: ``empty(0).set_(storage)``):
        # no kernel, no byte written. Counted as a write, it made a save's own copy race with it.
        return func(*args, **kwargs)
    written = _written(func, args, kwargs)
    if inputs and not any(gpu.is_device(t) for t in inputs):
        # a host op: the host itself reads and writes (Note [a modelled copy lands when it is seen])
        with gpu._lock:
            for t in inputs:
                gpu._reads(t, gpu._host_vc, f"host op {func}", None)
            for t in written:
                gpu._writes(t, None, None, gpu._host_vc, f"host op {func}")
        return func(*args, **kwargs)
    stream = gpu.current_stream()
    with gpu._lock:
        gpu.host_now += gpu.rates.launch_s
        _merge(stream.vc, gpu._host_vc)
        who = f"{func} on {stream.name}"
        for t in inputs:
            gpu._reads(t, stream.vc, who, stream)
        out = func(*args, **kwargs)
        outs = _tensors(out)
        seen = {id(t.untyped_storage()) for t in inputs}
        fresh = [t for t in outs if id(t.untyped_storage()) not in seen and gpu._record_of(t) is None]
        for t in fresh:
            gpu._register(t, DEVICE, stream)  # first: op_seconds counts the bytes it writes
        key = None
        if func in _NO_KERNEL:
            for t in fresh:
                poison(t)  # uninitialised device memory
        elif fresh or written:
            key, _ = gpu._enqueue(stream, "sm", op_seconds(gpu, func, args, kwargs, out), str(func))
        for t in written + fresh:
            gpu._writes(t, stream, key, stream.vc, who)
    if func is aten._local_scalar_dense.default:
        gpu._observe(stream.record_event())  # .item() waits for the stream
    return out
