"""The bench models' tiled forms (the max-seq modes' ``+tiled``, ``+tiled-layer`` and ``+tiled-heads``):
each block's MLP tiled along the sequence, or a Llama block tiled whole, attention whole or a group
of query heads at a time (:mod:`ssdtrain.longctx`)."""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.nn import functional as F

from ssdtrain.bench.models import LlamaBlock, apply_rope, rope_tables
from ssdtrain.longctx.sizing import LayerSizes

__all__ = ["block_sizes", "tile_layers", "tile_mlps"]


def tile_mlps(model: nn.Module, tile_tokens: int | None = None) -> int:
    """Tiles every block's ``mlp`` along the sequence (:func:`ssdtrain.longctx.tiled.tile_in_place`,
    ``tile_tokens`` positions a tile; ``None``: as many as the hidden size, ALST's default);
    returns how many. Works for both models: their MLPs are position-wise."""
    from ssdtrain.longctx.tiled import tile_in_place

    for block in model.blocks:
        tile_in_place(block.mlp, tile_tokens=tile_tokens)
    return len(model.blocks)


def tile_layers(model: nn.Module, tile_tokens: int | None = None, head_groups: int | None = None,
                layer_memory: int | None = None) -> int:
    """Tiles every :class:`LlamaBlock` whole along the sequence (the input norm, q/k/v and RoPE in
    tiles; attention over the whole sequence; the o-projection, both residuals, the second norm and
    the MLP in tiles: :mod:`ssdtrain.longctx.tiled_layer`), ``tile_tokens`` positions a tile
    (``None``: as many as the hidden size); returns how many. ``head_groups``: attention (and the
    q/k/v it takes) a group of query heads at a time, in that many groups
    (:mod:`ssdtrain.longctx.head_groups`; ``None``: all heads at once). ``layer_memory`` (with
    ``head_groups``): the bytes a recomputed layer may hold; at each sequence length a layer then
    takes fewer groups and longer tiles where they fit (:mod:`ssdtrain.longctx.sizing`), down to
    ``head_groups`` and ``tile_tokens`` where nothing coarser does. Llama-shaped models only."""
    from ssdtrain.longctx.tiled import replace_forward

    if not all(isinstance(block, LlamaBlock) for block in model.blocks):
        raise ValueError("tile_layers tiles Llama blocks (RMSNorm, RoPE, GQA, SwiGLU); tile a GPT's MLPs with tile_mlps")
    heads = model.blocks[0].attn.heads if len(model.blocks) else 1
    if head_groups is not None and (not isinstance(head_groups, int) or head_groups < 1 or heads % head_groups):
        raise ValueError(f"tile_layers: head_groups must divide the {heads} query heads, got {head_groups!r}")
    if layer_memory is not None and (head_groups is None or isinstance(layer_memory, bool)
                                     or not isinstance(layer_memory, int) or layer_memory < 1):
        raise ValueError(f"tile_layers: layer_memory is a positive int of bytes, with head_groups; got "
                         f"{layer_memory!r} with head_groups={head_groups!r}")
    for block in model.blocks:
        replace_forward(block, functools.partial(_tiled_block_forward, block, tile_tokens, head_groups, layer_memory))
    return len(model.blocks)


def block_sizes(block: LlamaBlock, x: torch.Tensor, tile_tokens: int | None, head_groups: int,
                layer_memory: int) -> LayerSizes:
    """What a :func:`tile_layers` block with ``layer_memory`` takes for ``x``: its own forward, or
    tiles and groups (:func:`ssdtrain.longctx.sizing.sized_heads`)."""
    from ssdtrain.longctx.sizing import sized_heads

    attn, (b, s, h) = block.attn, x.shape
    return sized_heads(s, b, hidden=h, heads=attn.heads, kv_heads=attn.kv, ffn_hidden=block.mlp.gate.out_features,
                       dtype_bytes=x.element_size(), memory=layer_memory, tile_tokens=tile_tokens or h,
                       head_groups=head_groups)


def _tiled_block_forward(block: LlamaBlock, tile_tokens: int | None, head_groups: int | None,
                         layer_memory: int | None, x: torch.Tensor) -> torch.Tensor:
    from ssdtrain.longctx.tiled import tile_bounds
    from ssdtrain.longctx.tiled_layer import params_of, tiled_parts

    attn = block.attn
    b, s, h = x.shape
    if layer_memory is not None:
        whole, tile_tokens, head_groups = block_sizes(block, x, tile_tokens, head_groups, layer_memory)
        if whole:  # the layer fits untiled: its own forward
            return type(block).forward(block, x)
    bounds = tile_bounds(s, tile_tokens=tile_tokens, default_tokens=h)

    # The rotary tables are made a tile at a time, not held whole: the Function keeps its part
    # (this closure) until backward, and whole tables per layer added up (32 layers x 2 x s x d:
    # a third more than the MLP-tiled model's peak at 4096 tokens on the CPU, 2026-11-28).
    def pre(lo: int, hi: int, xt: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n, t = block.ln1(xt), hi - lo
        q = attn.q(n).view(b, t, attn.heads, attn.d).transpose(1, 2)
        k = attn.k(n).view(b, t, attn.kv, attn.d).transpose(1, 2)
        v = attn.v(n).view(b, t, attn.kv, attn.d).transpose(1, 2)
        c, z = rope_tables(t, attn.d, attn.theta, xt.device, xt.dtype, start=lo)
        return apply_rope(q, c, z), apply_rope(k, c, z), v

    def post(lo: int, hi: int, xt: torch.Tensor, yt: torch.Tensor) -> tuple[torch.Tensor]:
        r = xt + attn.o(yt.transpose(1, 2).reshape(b, hi - lo, h))
        return (r + block.mlp(block.ln2(r)),)

    pre_params, post_params = params_of(block.ln1, attn.q, attn.k, attn.v), params_of(attn.o, block.ln2, block.mlp)
    if head_groups is not None:
        return _grouped(block, pre_params, post_params, post, bounds, head_groups, x)
    q, k, v = tiled_parts(pre, (x,), pre_params, bounds)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=attn.kv != attn.heads)
    (z,) = tiled_parts(post, (x, y), post_params, bounds)
    return z


def _grouped(block: LlamaBlock, pre_params: tuple, post_params: tuple, post, bounds: tuple, groups: int,
             x: torch.Tensor) -> torch.Tensor:
    """The tiled block with attention ``groups`` groups of query heads at a time
    (:func:`ssdtrain.longctx.head_groups.grouped_layer`); a group's q/k/v from its rows of the
    weights, so its projections cost only its share."""
    from ssdtrain.longctx.head_groups import group_heads, group_tiles, grouped_layer, kernel_available

    attn = block.attn
    b, d = x.shape[0], attn.d

    def part(lo: int, hi: int, g: int, xt: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # One product for the group's q, k and v rows, and RoPE once for q and k together: the
        # part runs four times a tile and a group (forward, recomputation, q/k/v again, replay).
        qs, ks = group_heads(attn.heads, attn.kv, groups, g)
        t, hq, hk = hi - lo, qs.stop - qs.start, ks.stop - ks.start
        rows = torch.cat((attn.q.weight[qs.start * d:qs.stop * d], attn.k.weight[ks.start * d:ks.stop * d],
                          attn.v.weight[ks.start * d:ks.stop * d]))
        qkv = F.linear(block.ln1(xt), rows).view(b, t, hq + 2 * hk, d).transpose(1, 2)
        c, z = rope_tables(t, d, attn.theta, xt.device, xt.dtype, start=lo)
        qk = apply_rope(qkv[:, :hq + hk], c, z)
        return qk[:, :hq], qk[:, hq:], qkv[:, hq + hk:]

    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])

    attend = None if kernel_available(x.device) else sdpa
    return grouped_layer(part, post, (x,), pre_params, post_params, bounds, groups, attn.kv, attend=attend,
                         part_bounds=group_tiles(bounds, groups))
