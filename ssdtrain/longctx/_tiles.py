"""The machinery a tiled module and a tiled layer share: a position-wise part run over the sequence
a tile at a time, forward without a graph and backward again with one (:func:`tiled_parts`), the
forward's RNG and autocast replayed, the recomputation's saves kept as autograd keeps them, and the
parameters' gradients summed over tiles. Its rules are written in :mod:`ssdtrain.longctx.tiled`'s
module docstring; :mod:`ssdtrain.longctx.tiled` (one input, one output: an MLP) and
:mod:`ssdtrain.longctx.tiled_layer` (several: a decoder layer's parts) are built on it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.autograd.function import once_differentiable

__all__ = ["GradSums", "partitioned", "refuse_partitioned", "replay_tile", "tiled_parts"]

Part = Callable[..., tuple[torch.Tensor, ...]]


def _same(t: Any) -> Any:
    return t


# The recomputation's saves, as autograd keeps them without hooks (module docstring).
def _keep_saves() -> contextlib.AbstractContextManager:
    return torch.autograd.graph.saved_tensors_hooks(_same, _same)


class _Replay:
    """The forward's RNG and autocast states, entered again in backward (as checkpoint does)."""

    def __init__(self, device: torch.device, preserve_rng_state: bool) -> None:
        self.device = device
        kinds = [device.type] if device.type == "cpu" else [device.type, "cpu"]
        self.autocast_state = [(k, torch.is_autocast_enabled(k), torch.get_autocast_dtype(k))
                               for k in kinds if torch.amp.is_autocast_available(k)]
        self.autocast_cache = torch.is_autocast_cache_enabled()
        self.cpu_rng = self.device_rng = None
        if preserve_rng_state:
            self.cpu_rng = torch.get_rng_state()
            mod = getattr(torch, device.type, None) if device.type != "cpu" else None
            if mod is not None and hasattr(mod, "get_rng_state") and getattr(mod, "is_initialized", lambda: True)():
                self.device_rng = mod.get_rng_state(device)

    @contextlib.contextmanager
    def rng(self) -> Iterator[None]:
        """The forward's RNG state, for the whole recomputation (the tiles draw in turn)."""
        if self.cpu_rng is None:
            yield
            return
        on_device = self.device_rng is not None
        with torch.random.fork_rng(devices=[self.device] if on_device else [],
                                   device_type=self.device.type if on_device else "cuda"):
            torch.set_rng_state(self.cpu_rng)
            if on_device:
                getattr(torch, self.device.type).set_rng_state(self.device_rng, self.device)
            yield

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """The forward's autocast state, for a tile's forward only (its gradients are taken
        outside, as a backward outside autocast takes them)."""
        with contextlib.ExitStack() as stack:
            for kind, enabled, dtype in self.autocast_state:
                stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled,
                                                   cache_enabled=self.autocast_cache))
            yield


class GradSums:
    """Each wanted parameter's gradient summed over the tiles, as autograd would get it once."""

    def __init__(self, n: int) -> None:
        self.sums: list[torch.Tensor | None] = [None] * n
        self.fresh = [False] * n  # whether sums[i] is ours to add into

    def add(self, i: int, g: torch.Tensor | None) -> None:
        if g is None:
            return
        if self.sums[i] is None:  # 16-bit gradients are summed in float32 (one rounding at the end)
            up = g.float() if g.is_floating_point() and g.element_size() < 4 else g
            self.sums[i], self.fresh[i] = up, up is not g
        elif self.fresh[i]:
            self.sums[i].add_(g)
        else:  # the first tile's gradient may alias autograd's buffers: never written
            self.sums[i], self.fresh[i] = self.sums[i] + g, True

    def grads(self, params: tuple, wanted: list[int]) -> list[torch.Tensor | None]:
        """Every parameter's gradient, in its dtype (``None`` for those not wanted)."""
        out: list[torch.Tensor | None] = [None] * len(params)
        for i, s in zip(wanted, self.sums):
            out[i] = None if s is None else s.to(params[i].dtype)
        return out


def tiled_parts(part: Part, inputs: tuple[torch.Tensor, ...], params: Iterable[torch.Tensor],
                bounds: tuple[tuple[int, int], ...], *, preserve_rng_state: bool = True) -> tuple[torch.Tensor, ...]:
    """``part`` over the sequence a tile at a time; returns its outputs over the whole sequence.

    Args:
        part: ``part(a, b, *input_tiles) -> tuple of output tiles``, position-wise along dim
            ``-2``: the output rows ``[a, b)`` depend on the input rows ``[a, b)`` only.
        inputs: its tensor inputs, the sequence at dim ``-2`` (all the same length).
        params: the parameters it uses that want gradients
            (:func:`ssdtrain.longctx.tiled_layer.params_of`).
        bounds: the tiles, ``(start, end)`` each (:func:`ssdtrain.longctx.tiled.tile_bounds`).
        preserve_rng_state: replay the forward's RNG state in backward.
    """
    params = tuple(params)
    if len(bounds) <= 1:
        return part(0, inputs[0].shape[-2], *inputs)
    wants = torch.is_grad_enabled() and (any(t.requires_grad for t in inputs) or params)
    if not wants:
        with torch.no_grad():
            return _forward_tiles(part, inputs, bounds)
    refuse_partitioned(params)
    return _TiledParts.apply(part, bounds, preserve_rng_state, len(inputs), *inputs, *params)


def partitioned(params: Iterable[torch.Tensor]) -> bool:
    """Whether any of ``params`` is a DeepSpeed ZeRO-3 partition (it carries a ``ds_id``)."""
    return any(hasattr(p, "ds_id") for p in params)


def refuse_partitioned(params: tuple[torch.Tensor, ...]) -> None:
    """A clear error for parameters DeepSpeed ZeRO-3 partitions (:func:`partitioned`): a tiled
    Function takes its parameters as inputs, to return their gradients, and outside its module's
    forward a ZeRO-3 parameter is an empty placeholder, so autograd would refuse the gradient deep in
    backward ("expected shape compatible with [0]", DeepSpeed 0.19.8)."""
    if partitioned(params):
        raise RuntimeError("ssdtrain.longctx: tiles under DeepSpeed ZeRO-3 (partitioned parameters) are not supported "
                           "yet: use ZeRO stage 1 or 2, or long_context(model, tile_tokens=0) for checkpointing and "
                           "the chunked loss without tiles")


def _forward_tiles(part: Part, inputs: tuple[torch.Tensor, ...],
                   bounds: tuple[tuple[int, int], ...]) -> tuple[torch.Tensor, ...]:
    """Each output written a tile at a time into one tensor (never two copies of it at once)."""
    outs: list[torch.Tensor] | None = None
    n = inputs[0].shape[-2]
    for a, b in bounds:
        ys = part(a, b, *(t.narrow(-2, a, b - a) for t in inputs))
        if outs is None:
            outs = [y.new_empty((*y.shape[:-2], n, y.shape[-1])) for y in ys]
        for out, y in zip(outs, ys):
            out.narrow(-2, a, b - a).copy_(y)
        del ys
    return tuple(outs)


class _TiledParts(torch.autograd.Function):
    """Forward: the tiles without a graph, the inputs saved. Backward: each tile again with a
    graph, its gradients taken at once; the inputs' written tile by tile, the parameters' summed
    over tiles and returned once."""

    @staticmethod
    def forward(ctx: Any, part: Part, bounds: tuple, preserve_rng_state: bool, n_inputs: int,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        inputs, params = tensors[:n_inputs], tensors[n_inputs:]
        ctx.part, ctx.bounds, ctx.n_inputs = part, bounds, n_inputs
        ctx.params = params  # the parameters: alive anyway, never activations
        ctx.replay = _Replay(inputs[0].device, preserve_rng_state)
        ctx.save_for_backward(*inputs)
        outs = _forward_tiles(part, inputs, bounds)
        ctx.mark_non_differentiable(*(o for o in outs if not o.is_floating_point() and not o.is_complex()))
        return outs

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grad_outs: torch.Tensor) -> tuple:
        inputs = ctx.saved_tensors
        n = ctx.n_inputs
        want_in = [i for i in range(n) if ctx.needs_input_grad[4 + i]]
        want_p = [i for i in range(len(ctx.params)) if ctx.needs_input_grad[4 + n + i]]
        targets = [ctx.params[i] for i in want_p]
        grad_in: list[torch.Tensor | None] = [torch.empty_like(inputs[i]) if i in want_in else None for i in range(n)]
        sums = GradSums(len(targets))
        replay = ctx.replay
        with replay.rng():
            for a, b in ctx.bounds:
                got = replay_tile(ctx.part, replay, a, b, inputs, want_in, targets, grad_outs)
                for i, g in zip(want_in, got):
                    dst = grad_in[i].narrow(-2, a, b - a)
                    dst.zero_() if g is None else dst.copy_(g)
                for j, g in enumerate(got[len(want_in):]):
                    sums.add(j, g)
                del got
        return (None, None, None, None, *grad_in, *sums.grads(ctx.params, want_p))


def replay_tile(part: Part, replay: _Replay, a: int, b: int, inputs: tuple[torch.Tensor, ...], want_in: list[int],
                targets: list[torch.Tensor], grad_outs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor | None, ...]:
    """``part`` again on the rows ``[a, b)`` of ``inputs``, with a graph (the forward's autocast
    state entered; its saves kept as autograd keeps them), and the gradients of its outputs, given
    ``grad_outs``' rows ``[a, b)``: those of the inputs ``want_in``, then of ``targets`` (``None``
    where unused)."""
    with torch.enable_grad(), _keep_saves():
        tiles = [t.narrow(-2, a, b - a).detach().requires_grad_(i in want_in) for i, t in enumerate(inputs)]
        with replay.autocast():
            # views, not the leaves: autocast caches its casts of leaves that want gradients
            ys = part(a, b, *(t.view_as(t) if t.requires_grad else t for t in tiles))
        pairs = [(y, g.narrow(-2, a, b - a)) for y, g in zip(ys, grad_outs) if y.requires_grad]
        wrt = [tiles[i] for i in want_in] + targets
        if not pairs:
            return (None,) * len(wrt)
        return torch.autograd.grad([y for y, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True)
