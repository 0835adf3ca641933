"""A decoder layer tiled whole with attention a group of query heads at a time: what is left whole
of a tiled layer (:mod:`ssdtrain.longctx.tiled_layer`) once its position-wise parts are tiled is q,
k, v, the attention output and their gradients, at attention's backward, the recomputed layer's
peak. Heads are independent, so :func:`grouped_layer` takes attention's gradients one group of
query heads at a time: backward makes the group's q, k and v again (from the layer's input, a
tile at a time, without a graph), takes attention's gradients of them, and replays the part a tile
at a time with a graph to carry them to the input and the parameters. The layer is one autograd
Function: of the whole sequence it keeps the layer's input, attention's output and its fp32
log-sum-exp; in backward the gradients of the layer's output, of its input (one buffer both
branches add into) and of attention's output; q, k, v and their gradients exist one group at a
time. The forward, which holds no gradients, takes every head at once (Note [forward takes every
head at once]).

``part(a, b, g, *input_tiles)`` returns group ``g``'s q (``(b, hq, t, d)``) and the key/value heads
its query heads use (``(b, hk, t, d)``, ``hq`` a multiple of ``hk``, or one key/value head shared
by a group smaller than its query heads).

Two ways to take attention's gradients:

* **kernel** (the default where it exists: the CPU's fused flash kernel,
  ``aten._scaled_dot_product_flash_attention_for_cpu``, which SDPA itself picks for a causal
  attention without a mask on the CPU): the kernel's own backward, from the saved output and
  log-sum-exp (no attention forward again). Each head's output and its q gradient are bitwise those
  of SDPA over all heads at once (the kernel computes heads apart); k's and v's gradients under
  grouped-query attention are summed over a group's heads and then over groups, so they differ
  from one SDPA call in the last bits, as the o-projection's and the input's sums over groups do.
* **recompute** (``attend`` given: any attention function, any device, a mask, a sliding window,
  dropout): backward runs each group's attention forward again with a graph (one attention forward
  more a step) and takes its gradients from autograd. With dropout (``random=True``) the forward
  runs attention a group at a time too, and backward replays the forward's RNG state so that each
  group draws the same masks; ``post`` is replayed under the RNG state it ran under.

Exactness against the untiled layer, autocast and RNG replay, parameters as inputs of the Function
(one gradient a backward, 16-bit ones summed in float32): as :mod:`ssdtrain.longctx.tiled`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from ssdtrain.longctx._tiles import GradSums, _forward_tiles, _keep_saves, _Replay, refuse_partitioned, replay_tile

__all__ = ["group_heads", "group_tiles", "grouped_layer", "kernel_available"]

GroupPart = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
Post = Callable[..., tuple[torch.Tensor]]
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def kernel_available(device: torch.device) -> bool:
    """Whether the kernel path runs on ``device`` (its fused kernel and backward are in this torch)."""
    return device.type == "cpu" and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward")


def group_heads(heads: int, kv_heads: int, groups: int, g: int) -> tuple[slice, slice]:
    """Group ``g``'s query heads and the key/value heads they use, of ``groups`` groups: a group is
    whole key/value heads with their query heads, or (more groups than key/value heads) some of
    one key/value head's query heads, which then share it."""
    hq, rep = heads // groups, heads // kv_heads
    k0, hk = g * hq // rep, max(1, hq // rep)
    return slice(g * hq, (g + 1) * hq), slice(k0, k0 + hk)


def group_tiles(bounds: tuple[tuple[int, int], ...], groups: int) -> tuple[tuple[int, int], ...]:
    """The tiles of the part's passes without a graph (the forward, the checkpoint's recomputation,
    and each group's q/k/v made again in backward): ``groups`` of ``bounds``' tiles at a time. A
    group's q, k and v are a ``groups``-th of the layer's, and a pass without a graph keeps nothing
    of a tile but its outputs, so longer tiles cost little memory and fewer calls: on the CPU each
    call's own cost, not its arithmetic, set a small layer's step (2026-11-28: the bench's CPU
    Llama, 4 groups at 2816 tokens, 0.98 s of CPU a step with the post's tiles, 0.80 with these
    for every pass). The replay with a graph keeps ``bounds``' tiles: it runs while a group's
    gradients exist, the layer's peak, where a tile's graph (the normed input, q/k/v and their
    gradients) adds to it (0.9 MiB at 4096 tokens with tiles 4 times as long)."""
    return tuple((bounds[i][0], bounds[min(i + groups, len(bounds)) - 1][1]) for i in range(0, len(bounds), groups))


def grouped_layer(part: GroupPart, post: Post, inputs: tuple[torch.Tensor, ...], pre_params: Iterable[torch.Tensor],
                  post_params: Iterable[torch.Tensor], bounds: tuple[tuple[int, int], ...], groups: int, kv_heads: int, *,
                  scale: float | None = None, attend: Attend | None = None, part_bounds: tuple | None = None,
                  random: bool = False, preserve_rng_state: bool = True) -> torch.Tensor:
    """A decoder layer: causal attention of ``groups`` groups of query heads, each group's q/k/v
    made by ``part`` from the inputs' tiles, then ``post`` a tile at a time on the layer's input and
    attention's output.

    Args:
        part: ``part(a, b, g, *input_tiles) -> (q, k, v)`` of group ``g``'s query heads and the
            key/value heads they use, for positions ``[a, b)``; position-wise along dim ``-2``.
        post: ``post(a, b, x_tile, y_tile) -> (z_tile,)``: the o-projection, residuals, norm and
            MLP of positions ``[a, b)``; ``x`` is ``inputs[0]``, ``y`` attention's output
            ``(b, heads, s, d)`` (its tile ``(b, heads, t, d)``).
        inputs: ``part``'s tensor inputs, the sequence at dim ``-2``; the first is the layer's input.
        pre_params, post_params: the parameters ``part`` and ``post`` use that want gradients.
        bounds: the tiles (:func:`ssdtrain.longctx.tiled.tile_bounds`).
        part_bounds: the tiles of ``part``'s passes without a graph (``None``: ``bounds``;
            :func:`group_tiles`); its replay with a graph takes ``bounds``.
        groups: how many groups; every group has the same number of query heads.
        kv_heads: the layer's key/value heads (each group's: :func:`group_heads`).
        scale: attention's scale (``None``: ``1/sqrt(head_dim)``).
        attend: ``None``: the kernel path (:func:`kernel_available` must hold); else
            ``attend(q, k, v) -> out``, ``(b, hq, s, d)``, the recompute path.
        random: ``attend`` draws random numbers (attention dropout): the forward runs it a group
            at a time, in backward's order (Note [forward takes every head at once]).
        preserve_rng_state: replay the forward's RNG state in backward.

    Returns the layer's output, shaped as ``inputs[0]``.
    """
    pre_params, post_params = tuple(pre_params), tuple(post_params)
    bounds = (tuple(bounds), tuple(part_bounds or bounds))
    if attend is None and not kernel_available(inputs[0].device):
        raise ValueError(f"grouped_layer: no fused attention kernel with a backward on {inputs[0].device}; "
                         "give attend= (the recompute path)")
    if not isinstance(groups, int) or groups < 1:
        raise ValueError(f"grouped_layer: groups must be a positive int, got {groups!r}")
    if not isinstance(kv_heads, int) or kv_heads < 1:
        raise ValueError(f"grouped_layer: kv_heads must be a positive int, got {kv_heads!r}")
    wants = torch.is_grad_enabled() and (any(t.requires_grad for t in inputs) or pre_params or post_params)
    if not wants:
        with torch.no_grad():
            y, _ = _attention(part, inputs, bounds[1], groups, kv_heads, scale, attend, random)
            return _forward_tiles(post, (inputs[0], y), bounds[0])[0]
    refuse_partitioned(pre_params + post_params)
    return _GroupedLayer.apply(part, post, bounds, groups, kv_heads, scale, attend, random, preserve_rng_state,
                               len(inputs), len(pre_params), *inputs, *pre_params, *post_params)


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU flash kernel over ``q`` (``b, hq, s, d``) and its key/value heads (``b, hk, s, d``):
    each key/value head's query heads as the heads of one batch entry, the key head expanded (a
    view): no copy of k or v."""
    b, hq, s, d = q.shape
    qb, kb, vb = _batched(q, k, v)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qb, kb, vb, 0.0, True, scale=scale)
    return out.reshape(b, hq, s, d), lse.reshape(b, hq, s)


def _flash_backward(dy: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, scale: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's own backward for :func:`_flash`; a key/value head's gradient summed over its
    query heads."""
    b, hq, s, d = q.shape
    hk = k.shape[1]
    qb, kb, vb = _batched(q, k, v)
    rows = (b * hk, hq // hk)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dy.reshape(*rows, s, d), qb, kb, vb, out.reshape(*rows, s, d), lse.reshape(*rows, s), 0.0, True, scale=scale)
    return dq.reshape(b, hq, s, d), dk.sum(1).reshape(b, hk, s, d), dv.sum(1).reshape(b, hk, s, d)


def _batched(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    b, hq, s, d = q.shape
    hk = k.shape[1]
    rep = hq // hk
    return (q.reshape(b * hk, rep, s, d), k.reshape(b * hk, 1, s, d).expand(-1, rep, -1, -1),
            v.reshape(b * hk, 1, s, d).expand(-1, rep, -1, -1))


def _group_qkv(part: GroupPart, inputs: tuple, bounds: tuple, g: int) -> tuple[torch.Tensor, ...]:
    return _forward_tiles(functools.partial(_at_group, part, g), inputs, bounds)


def _at_group(part: GroupPart, g: int, a: int, b: int, *tiles: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return part(a, b, g, *tiles)


def _attention(part: GroupPart, inputs: tuple, bounds: tuple, groups: int, kv_heads: int, scale: float | None,
               attend: Attend | None, per_group: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention's output over every head (and, kernel path, its log-sum-exp), in one call.

    Note [forward takes every head at once]: a forward holds much less than the backward after it
    (no gradients), so the forward, and the checkpoint's recomputation of it, assemble every
    group's q, k and v whole and run attention once over all heads: a kernel call per group cost
    the bench's CPU Llama more than the heads' arithmetic (2026-11-28, 2 threads, 2816 tokens: a
    head's forward 3.8 ms, four heads' 11.9). q, k and v are the groups' own (``part`` per group),
    so backward's, made again a group at a time, are the same numbers; the kernel computes each
    head apart, so each head's output and log-sum-exp are those of a call over its group alone.
    ``per_group`` (an ``attend`` that draws random numbers: attention dropout): attention a group
    at a time, in the order backward runs them again, so that each group draws the same masks."""
    q = k = v = None
    for g in range(groups):
        qg, kg, vg = _group_qkv(part, inputs, bounds, g)
        if q is None:
            b, hq, s, d = qg.shape
            q = qg.new_empty((b, hq * groups, s, d))
            k, v = kg.new_empty((b, kv_heads, s, d)), vg.new_empty((b, kv_heads, s, d))
        rows, kv_rows = group_heads(q.shape[1], kv_heads, groups, g)
        q[:, rows].copy_(qg)
        k[:, kv_rows].copy_(kg)
        v[:, kv_rows].copy_(vg)
        del qg, kg, vg
    if attend is None:
        # as SDPA under autocast (the kernel is called here past autocast's dispatch): the
        # autocast dtype, else one dtype for the three (RoPE's tables may have promoted q and k)
        dev = q.device.type
        dtype = (torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev)
                 else torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype))
        return _flash(q.to(dtype), k.to(dtype), v.to(dtype), scale)
    if not per_group:
        return attend(q, k, v), None
    out = None  # attention with dropout: a group at a time, as backward draws its masks again
    for g in range(groups):
        rows, kv_rows = group_heads(q.shape[1], kv_heads, groups, g)
        y = attend(q[:, rows], k[:, kv_rows], v[:, kv_rows])
        if out is None:
            out = y.new_empty((y.shape[0], q.shape[1], *y.shape[2:]))
        out[:, rows].copy_(y)
        del y
    return out, None


class _GroupedLayer(torch.autograd.Function):
    """Forward, without a graph: each group's q/k/v from the inputs' tiles and its attention, then
    ``post``'s tiles; saved: the inputs, attention's output (and, kernel path, its log-sum-exp).
    Backward: ``post``'s tiles again with a graph (the input's gradient and attention's output's,
    each written whole once), then per group q/k/v again, attention's gradients, and ``part``'s
    tiles replayed with a graph, their input gradients added into the same buffer: the input's
    gradient is one tensor, not one per branch summed after."""

    @staticmethod
    def forward(ctx: Any, part: GroupPart, post: Post, bounds: tuple, groups: int, kv_heads: int,
                scale: float | None, attend: Attend | None, random: bool, preserve_rng_state: bool, n_inputs: int,
                n_pre: int,
                *tensors: torch.Tensor) -> torch.Tensor:
        inputs = tensors[:n_inputs]
        ctx.part, ctx.post, ctx.groups, ctx.scale, ctx.attend = part, post, groups, scale, attend
        ctx.bounds, ctx.part_bounds = bounds
        ctx.n_inputs, ctx.n_pre = n_inputs, n_pre
        ctx.params = tensors[n_inputs:]  # alive anyway, never activations
        ctx.replay = _Replay(inputs[0].device, preserve_rng_state)
        y, lse = _attention(part, inputs, ctx.part_bounds, groups, kv_heads, scale, attend, random)
        ctx.replay_post = _Replay(inputs[0].device, preserve_rng_state)  # post's own RNG state
        (z,) = _forward_tiles(post, (inputs[0], y), ctx.bounds)
        ctx.save_for_backward(*inputs, y, *(() if lse is None else (lse,)))
        return z

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_z: torch.Tensor) -> tuple:
        n, saved, skip = ctx.n_inputs, ctx.saved_tensors, 11
        inputs, y = saved[:n], saved[n]
        lse = saved[n + 1] if ctx.attend is None else None
        want_in = [i for i in range(n) if ctx.needs_input_grad[skip + i]]
        want_p = [i for i in range(len(ctx.params)) if ctx.needs_input_grad[skip + n + i]]
        pre_want = [i for i in want_p if i < ctx.n_pre]
        post_want = [i for i in want_p if i >= ctx.n_pre]
        # the layer input's gradient: every row written by post's backward, then the groups' added;
        # the part's other inputs' only added
        grad_in: list[torch.Tensor | None] = [None if i not in want_in else torch.empty_like(inputs[i]) if i == 0
                                              else torch.zeros_like(inputs[i]) for i in range(n)]
        pre_sums, post_sums = GradSums(len(pre_want)), GradSums(len(post_want))
        with ctx.replay_post.rng():
            dy = _post_backward(ctx, inputs[0], y, grad_z, grad_in[0], [ctx.params[i] for i in post_want], post_sums)
        with ctx.replay.rng():
            for g in range(ctx.groups):
                grads = _attention_backward(ctx, g, inputs, y, lse, dy)
                _replay_part(ctx, g, inputs, grads, want_in, [ctx.params[i] for i in pre_want], grad_in, pre_sums)
                del grads
        params = list(pre_sums.grads(ctx.params, pre_want))
        for i, t in enumerate(post_sums.grads(ctx.params, post_want)):
            if t is not None:
                params[i] = t
        return (None,) * skip + (*grad_in, *params)


def _post_backward(ctx: Any, x: torch.Tensor, y: torch.Tensor, grad_z: torch.Tensor, dx: torch.Tensor | None,
                   targets: list, sums: GradSums) -> torch.Tensor:
    """``post`` again a tile at a time with a graph: the input's gradient written into ``dx``, the
    parameters' into ``sums``; returns attention's output's gradient (whole, ``y``'s layout)."""
    dy = torch.empty_like(y)
    want = [1] if dx is None else [0, 1]
    for a, b in ctx.bounds:
        got = replay_tile(ctx.post, ctx.replay, a, b, (x, y), want, targets, (grad_z,))
        for dst, t in zip([dy] if dx is None else [dx, dy], got):
            rows = dst.narrow(-2, a, b - a)
            rows.zero_() if t is None else rows.copy_(t)
        for j, t in enumerate(got[len(want):]):
            sums.add(j, t)
        del got
    return dy


def _attention_backward(ctx: Any, g: int, inputs: tuple, y: torch.Tensor, lse: torch.Tensor | None,
                        dy: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Group ``g``'s q, k and v made again (without a graph) and attention's gradients of them."""
    with torch.no_grad(), ctx.replay.autocast():
        q, k, v = _group_qkv(ctx.part, inputs, ctx.part_bounds, g)
    hq = q.shape[1]
    rows = slice(g * hq, (g + 1) * hq)
    if ctx.attend is None:
        dt = y.dtype  # the forward's kernel ran in it (_attention); the gradients go back in q/k/v's own
        grads = _flash_backward(dy[:, rows].to(dt), q.to(dt), k.to(dt), v.to(dt), y[:, rows], lse[:, rows], ctx.scale)
        return tuple(g.to(t.dtype) for g, t in zip(grads, (q, k, v)))
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    with torch.enable_grad(), _keep_saves():
        with ctx.replay.autocast():
            out = ctx.attend(*leaves)
        return torch.autograd.grad(out, leaves, dy[:, rows])


def _replay_part(ctx: Any, g: int, inputs: tuple, grads: tuple, want_in: list[int], targets: list,
                 grad_in: list, sums: GradSums) -> None:
    """Group ``g``'s part again, a tile at a time with a graph, its q/k/v gradients carried back:
    the inputs' gradients added into ``grad_in``, the parameters' into ``sums``."""
    part = functools.partial(_at_group, ctx.part, g)
    for a, b in ctx.bounds:
        got = replay_tile(part, ctx.replay, a, b, inputs, want_in, targets, grads)
        for i, t in zip(want_in, got):
            if t is not None:
                grad_in[i].narrow(-2, a, b - a).add_(t)
        for j, t in enumerate(got[len(want_in):]):
            sums.add(j, t)
        del got
