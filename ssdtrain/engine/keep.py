"""What never goes to storage: parameters, what is not plain bytes, saves inside opted-out modules.

Pack asks :func:`as_is` first; a tensor it keeps is handed back to autograd as an alias. Also the
module hooks that tell pack where it is (which block runs; whether an opted-out module does).
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import types
from collections.abc import Iterable, Iterator, Mapping
from functools import partial
from typing import Any

import torch
from torch import nn

from ssdtrain.device import cuda as device
from ssdtrain.config import OffloadConfig

__all__ = ["as_is", "alias", "no_offload"]


def resolve_config(config: Any, overrides: dict[str, Any]) -> tuple[OffloadConfig, list[nn.Module]]:
    """The Offloader's settings from ``config`` (an OffloadConfig, a mapping or None) and keyword
    ``overrides``, and the modules given directly in ``keep_modules`` (names stay in the config)."""
    opted_out = overrides.get("keep_modules")
    objects = [m for m in (opted_out or ()) if isinstance(m, nn.Module)]
    if objects:
        overrides["keep_modules"] = tuple(m for m in opted_out if not isinstance(m, nn.Module))
    if isinstance(config, Mapping):
        config = OffloadConfig.from_dict(config)
    elif config is not None and not isinstance(config, OffloadConfig):
        raise TypeError(f"config must be an OffloadConfig or a mapping, not {type(config).__name__}")
    return (OffloadConfig.from_dict(overrides) if config is None else config.replace(**overrides)), objects


# Note [our hooks are never traced]: torch.compile's frame evaluation may try to compile any
# Python frame that runs while it is installed, the pack and unpack hooks that autograd calls
# included: torch 2.11 does, around a graph break in a compiled forward. It then traces locks,
# os.getpid and I/O it cannot follow, warns and breaks the graph at every save. Once dynamo is
# loaded (a process that has not imported it compiles nothing), the hooks pushed are wrapped in
# ``torch.compiler.disable``: they always run as the Python they are (about 0.5 us a call).
_UNTRACED: dict[Any, Any] = {}


def untraced(hook: Any) -> Any:
    """The bound method ``hook`` as it is pushed (Note [our hooks are never traced])."""
    if "torch._dynamo" not in sys.modules:
        return hook
    fn = hook.__func__
    wrapped = _UNTRACED.get(fn)
    if wrapped is None:
        wrapped = _UNTRACED[fn] = torch.compiler.disable(fn)
    return types.MethodType(wrapped, hook.__self__)


class PackHook(partial):
    """The pack hook as it is pushed: ``func`` (the offloader's pack, called at C speed), with
    the offloader as ``__self__`` (``Scopes.opened_by``), and ``probe()`` run when torch asks it
    whether it is checkpoint's own hook (Note [SAC without the switch is told] in ``sac_probe.py``)."""

    def __getattr__(self, name: str) -> Any:
        if name == "_checkpoint_internal":
            probe = self.__dict__.get("probe")
            if probe is not None:
                probe()
        raise AttributeError(name)


def pack_hook(pack: Any, owner: Any, probe: Any) -> Any:
    """``pack`` (as :func:`untraced` gives it), wrapped in a :class:`PackHook` where ``probe``."""
    if probe is None:
        return pack
    hook = PackHook(pack)
    hook.__self__ = owner
    hook.probe = probe
    for name in ("_torchdynamo_disable", "__wrapped__"):  # Note [our hooks are never traced]
        if hasattr(pack, name):
            setattr(hook, name, getattr(pack, name))
    return hook


def enter_hooks(pack: Any, unpack: Any, active: list, scope: Any) -> None:
    """Pushes saved-tensor hooks and records ``[pack, scope]`` in ``active``.

    Note [an interrupt never unbalances a count]: the push is torch's own C call (not
    ``saved_tensors_hooks.__enter__``, Python code at whose start a Ctrl-C can strike), and
    hooks pushed by a call cut short would stay for good (no ``__exit__`` follows an
    ``__enter__`` that raised): they are popped again.
    """
    rec = [pack, scope]
    try:
        torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)
        active.append(rec)
    except BaseException:
        if active and active[-1] is rec:
            active.pop()
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if top is not None and top[0] == pack:
            torch._C._autograd._pop_saved_tensors_default_hooks()
        raise


def leave_stale_steps(owner: Any, active: list) -> list:
    """Pops the hooks of ``owner``'s steps (``with off:``) still open on top; returns their scopes.

    Note [an interrupt never unbalances a count]: a Ctrl-C as ``Offloader.__exit__`` (or the
    call in it that pops the hooks) began leaves the hooks pushed and the step open. The next
    ``with off:`` nests in it (Note [nested blocks are one]); ``close()`` leaves it.
    """
    left = []
    while active and getattr(active[-1][0], "__self__", None) is owner and active[-1][1].stats_id is None:
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if top is None or top[0] != active[-1][0]:
            break
        torch._C._autograd._pop_saved_tensors_default_hooks()
        left.append(active.pop()[1])
    return left


def install_hooks(blocks: list[nn.Module], kept: list[nn.Module], layer_stack: list[int],
                  keep_depth: list[int]) -> list:
    """Forward hooks that tell pack which block runs (``layer_stack``) and whether a module of
    ``keep_modules`` does (``keep_depth``: Note [opted-out modules]); returns their handles."""
    handles = []
    layers = LayerTracker(layer_stack)
    for i, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(partial(layers.enter, i)))
        handles.append(block.register_forward_hook(layers.leave, always_call=True))
    for m in kept:
        handles.append(m.register_forward_pre_hook(partial(bump, keep_depth, 1)))
        handles.append(m.register_forward_hook(partial(bump, keep_depth, -1), always_call=True))
    return handles


# Note [a DTensor is saved by its parts]: torch's tensor parallelism (``parallelize_module``,
# torchtitan) runs the sharded linears on DTensors, and autograd saves the DTensor, a wrapper
# with no bytes of its own: about 40% of a TP block's saved bytes, 60% with sequence parallelism
# (norms and residuals on the sequence's shard), in tests/_recipes_worker.py's block. Such a save is
# taken apart with the subclass's own ``__tensor_flatten__`` (the protocol torch.compile traces
# it by): each plain tensor part is saved as any other tensor (found, kept or written), the
# other parts (a DeviceMesh) and the flatten context are held as they are, and unpack puts the
# same parts back together with ``__tensor_unflatten__``: the same local bytes, placements and
# shape, so backward computes exactly what it would have. Only the subclasses listed here are
# taken apart (module, name; looked up only where that module is already imported): others may
# keep state outside their parts, and stay in memory.
_BY_PARTS = (("torch.distributed.tensor", "DTensor"),)


def by_parts(t: torch.Tensor) -> bool:
    """Whether ``t`` is a tensor subclass saved by its parts (Note [a DTensor is saved by its parts])."""
    cls = type(t)
    for module, name in _BY_PARTS:
        found = sys.modules.get(module)
        if found is not None and getattr(found, name, None) is cls:
            return True
    return False


def as_is(t: torch.Tensor, pinned: frozenset[int], in_kept_module: bool) -> bool:
    """Whether ``t`` is not an activation, or not one we can store as bytes: kept as it is.

    A DTensor that is an activation is not kept here: it is saved by its parts (pack asks
    again for each of them).

    Args:
        pinned: storage keys of the model's parameters and buffers (of their parts, for DTensors).
        in_kept_module: a module of ``keep_modules`` is running.

    Raises:
        RuntimeError: a CUDA tensor saved during CUDA graph capture (its I/O would run on the host).
    """
    plain = type(t) is torch.Tensor
    if not (plain or by_parts(t)) or t.layout is not torch.strided or t.is_inference():
        return True  # parameters (nn.Parameter), tensor subclasses, sparse, inference tensors
    # Not the seam's is_cuda: the modelled GPU's tensors are CPU tensors, eligible as such, and
    # never captured (Note [an offloader made under the modelled GPU]); a call here is paid per save.
    cuda = t.is_cuda
    if (not (cuda or t.is_cpu or (t.is_meta and device.modelled_gpu() is not None))  # Note [a modelled GPU without data]
            or t.numel() == 0 or t.is_quantized or t._is_zerotensor()):
        return True  # quantized: scales and zero points live outside the bytes
    if in_kept_module:
        return True
    base = t._base
    if t.requires_grad and t.is_leaf and base is None:
        return True  # a leaf that wants gradients lives anyway (a parameter in all but name)
    if base is not None and ((type(base) is not torch.Tensor and not by_parts(base)) or
                             (base.requires_grad and base.is_leaf)):
        return True  # a view of a parameter (e.g. weight.t() saved by mm)
    if _is_weight_cast(base if base is not None else t):
        return True
    if cuda and device.capturing():
        raise RuntimeError("ssdtrain cannot offload inside CUDA graph capture (its I/O runs on the host); "
                           "capture the graph outside the Offloader, or wrap it in ssdtrain.no_offload()")
    if not plain:
        return False  # its parts are asked about one by one
    try:
        return t.untyped_storage()._cdata in pinned
    except (RuntimeError, NotImplementedError):
        return True  # no real storage (functional / fake tensors)


def parts(t: torch.Tensor) -> tuple[dict[str, Any], Any]:
    """A subclass tensor's parts by name (tensors, and objects such as a DeviceMesh) and the
    context ``__tensor_unflatten__`` takes back: its ``__tensor_flatten__``, read once here."""
    names, ctx = t.__tensor_flatten__()
    return {name: getattr(t, name) for name in names}, ctx


# Note [a model's storages are found in one walk]
# Each forward begins by finding the storages of the models' parameters and buffers (pack hands
# their saves back as they are; FSDP and ZeRO-3 make them anew each step, so they are found each
# step). ``Module.parameters()`` and ``buffers()`` walk the module tree twice and name every tensor
# on the way: 160 us a step for pack_cost's twelve-block GPT on the CPU (2026-11-29), half a
# microsecond a save. One walk of ``modules()`` reading each module's own ``_parameters`` and
# ``_buffers`` finds the same tensors (a tensor shared by two modules twice: its key once).
def model_storage_keys(models: Iterable[torch.nn.Module]) -> frozenset[int]:
    """The storage keys of ``models``' parameters and buffers (:func:`storage_keys`), in one walk
    of each module tree."""
    return storage_keys(t for m in models for mod in m.modules()
                        for t in itertools.chain(mod._parameters.values(), mod._buffers.values()) if t is not None)


def storage_keys(tensors: Iterator[torch.Tensor]) -> frozenset[int]:
    """The storage keys of ``tensors`` (parameters, buffers), and of their parts for the
    subclasses saved by parts (a DTensor parameter's local shard)."""
    keys = set()
    for t in tensors:
        if type(t) is not nn.Parameter and type(t) is not torch.Tensor and by_parts(t):  # plain ones: no call
            keys.update(storage_keys(p for p in parts(t)[0].values() if isinstance(p, torch.Tensor)))
            continue
        try:
            keys.add(t.untyped_storage()._cdata)
        except (RuntimeError, NotImplementedError):
            pass  # no real storage: nothing of it is ever written
    return frozenset(keys)


def version_guard(t: torch.Tensor, tensor_parts: Iterable[str]) -> torch.Tensor:
    """A detached alias of the subclass tensor ``t`` that shares its version counter (autograd's
    ``detach`` does, also for a subclass) and holds none of its bytes: its tensor parts are
    replaced by empty ones. Only its ``_version`` is ever read (``cache.Parts``)."""
    guard = t.detach()
    for name in tensor_parts:
        setattr(guard, name, getattr(guard, name).new_empty(0))
    return guard


def alias(t: torch.Tensor) -> torch.Tensor:
    """What a pack hook returns to keep a tensor in memory.

    Not the output tensor itself: the graph would then hold its own output (a reference cycle
    through C++), and frameworks that later swap that output's ``.data`` to free it (Megatron's
    ``deallocate_output_tensor``) would swap the saved bytes too. A detached alias shares the
    storage and the version counter, and neither problem.
    """
    return t if t.is_leaf else t.detach()


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


@contextlib.contextmanager
def no_offload() -> Iterator[None]:
    """Tensors saved inside stay in memory, even within an offloading region."""
    # Innermost saved-tensor hooks win: identity hooks shadow any offloader's.
    with torch.autograd.graph.saved_tensors_hooks(alias, _identity):
        yield


def in_no_offload() -> bool:
    """Whether the innermost saved-tensor hooks are :func:`no_offload`'s."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return top is not None and top[1] is _identity


def model_list(model: Any) -> list[nn.Module]:
    if model is None:
        return []
    if isinstance(model, nn.Module):
        return [model]
    if isinstance(model, (list, tuple)) and model and all(isinstance(m, nn.Module) for m in model):
        return list(model)  # model chunks (interleaved pipelines), first layers first
    raise TypeError(f"model must be an nn.Module, a list of them (model chunks), or None; not {type(model).__name__}")


def named_module(models: list[nn.Module], name: str) -> nn.Module:
    for m in models:
        try:
            return m.get_submodule(name)
        except AttributeError:
            continue
    raise ValueError(f"keep_modules: no submodule {name!r} in the model; give dotted names as in "
                     "model.named_modules() (e.g. 'lm_head'), or the modules themselves")


def _is_weight_cast(t: torch.Tensor) -> bool:
    """A low-precision copy of a parameter (autograd's cast cache, ``w.half()``): kept, like the
    parameter itself; it is made once per forward and is not an activation."""
    fn = t.grad_fn
    if fn is None or type(fn).__name__ != "ToCopyBackward0":
        return False
    nxt = fn.next_functions
    return bool(nxt) and nxt[0][0] is not None and type(nxt[0][0]).__name__ == "AccumulateGrad"


# Note [module hooks do nothing when traced]: torch.compile traces these forward hooks into the
# graph, and a change to a Python list inside ``checkpoint`` (a higher-order op) is a side effect
# it refuses: the whole checkpointed region would fall back to eager (with SAC, its saves would
# then bypass the hooks again). A compiled graph's saves are made when it runs, not while these
# hooks run, so there is nothing for them to tag: traced, they do nothing.
def bump(depth: list[int], delta: int, module: nn.Module, *args: Any) -> None:
    if not torch.compiler.is_compiling():
        depth[0] = max(0, depth[0] + delta)


class LayerTracker:
    """Forward hooks on the blocks: which block is running (a stack, for nested calls)."""

    def __init__(self, stack: list[int]) -> None:
        self.stack = stack

    def enter(self, index: int, module: nn.Module, args: Any) -> None:
        if not torch.compiler.is_compiling():
            self.stack.append(index)

    def leave(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.stack and not torch.compiler.is_compiling():
            self.stack.pop()


