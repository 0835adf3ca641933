"""Position-wise parts of a layer computed a tile of the sequence at a time, with several inputs
and outputs: what tiles a whole decoder layer, not only its MLP.

With every block input offloaded and the MLP tiled (:mod:`ssdtrain.longctx.tiled`), the recomputed
layer's attention half is what is left at the peak: the normalized input, q, k and v before and
after the rotary positions, attention's output, the o-projection's output, the residual, the
post-attention norm, each as long as the sequence, with their gradients. All of it but attention
itself is position-wise. :func:`tiled_parts` runs such a part a tile at a time, forward without a
graph and backward again with one, as the tiled MLP does; a layer then becomes::

    q, k, v = tiled_parts(pre, (x,), params_of(ln1, q_proj, k_proj, v_proj), bounds)  # norm, q/k/v, RoPE
    y = attention(q, k, v)                                                             # the whole sequence
    (z,) = tiled_parts(post, (x, y), params_of(o_proj, ln2, mlp), bounds)             # o, residuals, norm, MLP

and the only whole-sequence tensors in it are the layer's input and output, what the attention
kernel needs (q, k, v, its output and log-sum-exp) and their gradients. ``pre(a, b, x_tile)``
and ``post(a, b, x_tile, y_tile)`` are given the tile's positions ``[a, b)`` (the rotary tables'
rows). Every input and output has the sequence at dim ``-2`` (``(batch, seq, hidden)``, or
``(batch, heads, seq, head_dim)``: q, k, v and attention's output as SDPA takes them).

Exactness, RNG and autocast replay, parameters as the Function's inputs (one weight gradient per
backward, summed over tiles in float32 for 16-bit parameters), and saved-tensor hooks: as
:mod:`ssdtrain.longctx.tiled` (its module docstring), whose machinery this shares.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from ssdtrain.longctx.tiled import GradSums, _keep_saves, _Replay

__all__ = ["params_of", "tiled_parts"]

Part = Callable[..., tuple[torch.Tensor, ...]]


def params_of(*modules: nn.Module) -> tuple[torch.Tensor, ...]:
    """The parameters of ``modules`` that want gradients, each once (a tied weight too)."""
    seen: dict[int, torch.Tensor] = {}
    for m in modules:
        for p in m.parameters():
            if p.requires_grad:
                seen.setdefault(id(p), p)
    return tuple(seen.values())


def tiled_parts(part: Part, inputs: tuple[torch.Tensor, ...], params: Iterable[torch.Tensor],
                bounds: tuple[tuple[int, int], ...], *, preserve_rng_state: bool = True) -> tuple[torch.Tensor, ...]:
    """``part`` over the sequence a tile at a time; returns its outputs over the whole sequence.

    Args:
        part: ``part(a, b, *input_tiles) -> tuple of output tiles``, position-wise along dim
            ``-2``: the output rows ``[a, b)`` depend on the input rows ``[a, b)`` only.
        inputs: its tensor inputs, the sequence at dim ``-2`` (all the same length).
        params: the parameters it uses that want gradients (:func:`params_of`).
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
    return _TiledParts.apply(part, bounds, preserve_rng_state, len(inputs), *inputs, *params)


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
        with replay.rng(), torch.enable_grad(), _keep_saves():
            for a, b in ctx.bounds:
                tiles = [t.narrow(-2, a, b - a).detach().requires_grad_(i in want_in) for i, t in enumerate(inputs)]
                with replay.autocast():
                    # views, not the leaves: autocast caches its casts of leaves that want gradients
                    ys = ctx.part(a, b, *(t.view_as(t) if t.requires_grad else t for t in tiles))
                pairs = [(y, g.narrow(-2, a, b - a)) for y, g in zip(ys, grad_outs) if y.requires_grad]
                wrt = [tiles[i] for i in want_in] + targets
                if pairs:
                    grads = torch.autograd.grad([y for y, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True)
                else:
                    grads = (None,) * len(wrt)
                del ys, pairs
                for i, g in zip(want_in, grads[:len(want_in)]):
                    dst = grad_in[i].narrow(-2, a, b - a)
                    dst.zero_() if g is None else dst.copy_(g)
                for j, g in enumerate(grads[len(want_in):]):
                    sums.add(j, g)
                del grads
        return (None, None, None, None, *grad_in, *sums.grads(ctx.params, want_p))
