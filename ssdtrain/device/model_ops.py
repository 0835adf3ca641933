"""The modelled GPU's compute: a dispatch mode that charges every aten op to the current
modelled stream and counts the device memory ops make.

An op takes ``max(flops / Rates.flops_per_s, bytes / Rates.hbm_bytes_per_s)``: its FLOPs from
``torch.utils.flop_counter``'s formulas (matmuls, convolutions, attention; zero for the rest),
its bytes the device tensors it reads and writes. The host pays ``Rates.launch_s`` per op.
"""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop, sdpa_flop

from ssdtrain.device.model import DEVICE, ModelledGPU, _merge, poison

__all__ = ["ModelledCompute", "fused_attention", "op_seconds"]

aten = torch.ops.aten
_lock = threading.Lock()

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
        self._fused = None

    def __enter__(self):
        if not self.gpu.data:  # Note [attention on a modelled GPU without data]
            self._fused = fused_attention()
            self._fused.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        if self._fused is not None:
            fused, self._fused = self._fused, None
            fused.__exit__(*exc)
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return run_op(self.gpu, func, args, kwargs or {})


# Note [attention on a modelled GPU without data]
# ``F.scaled_dot_product_attention`` picks its kernel by device: a GPU runs a fused (flash or
# memory-efficient) kernel that saves q, k, v, the output and the log-sum-exp, never the s x s
# scores; meta tensors take the math path, which makes and saves the scores (at 24k tokens, GiBs
# a layer the GPU never holds). On a modelled GPU without data the call is therefore routed to
# one fused op (the CPU's flash kernel, which has meta shapes and a backward, and is charged with
# the CUDA kernel's FLOPs). With grouped-query attention its k and v are repeated to the query
# heads first (the CUDA kernels read them shared: the model counts those bytes as well); an
# explicit mask keeps the math path, as on a GPU without a fused kernel for it. The route is the
# module attribute ``torch.nn.functional.scaled_dot_product_attention``, replaced while the
# compute mode is entered and put back on exit: a torch function mode is not active where
# checkpointing recomputes (inside backward), and the replacement changes nothing for tensors
# that are not meta.
_ORIGINAL = F.scaled_dot_product_attention
_entered = [0]


@contextlib.contextmanager
def fused_attention():
    """Routes ``F.scaled_dot_product_attention`` on meta tensors to a fused kernel while inside
    (Note [attention on a modelled GPU without data])."""
    with _lock:
        _entered[0] += 1
        F.scaled_dot_product_attention = _route
    try:
        yield
    finally:
        with _lock:
            _entered[0] -= 1
            if not _entered[0]:
                F.scaled_dot_product_attention = _ORIGINAL


def _route(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if attn_mask is not None or not query.is_meta:
        return _ORIGINAL(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                         scale=scale, enable_gqa=enable_gqa)
    heads = query.size(-3)
    if enable_gqa and key.size(-3) != heads:
        key = key.repeat_interleave(heads // key.size(-3), dim=-3)
        value = value.repeat_interleave(heads // value.size(-3), dim=-3)
    return aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, dropout_p, is_causal, scale=scale)[0]


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
