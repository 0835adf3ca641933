"""Tiles and head groups sized to memory: a layer tiled whole with attention a group of heads at a
time (``tile="heads"``) pays for every tile and every group in calls (each group a kernel call and
its q/k/v made again, each tile three passes of the position-wise parts), which a short sequence,
whose whole layer fits, does not need. Given the memory the recomputed layer may hold, a layer
takes, at each sequence length, the cheapest form whose backward peak, as the planner models it
(:mod:`ssdtrain.planner.plan_layer`), fits: its own forward, untiled (``block_working_bytes``),
else the fewest groups and then the longest tiles (``layer_heads_moments``); where nothing coarser
fits, the finest the user gave (their tile length and number of groups).

The choice depends on the sequence, the shape and the memory alone, never on what happens to be
free at the moment: the same step gives the same tiles with or without an offloader, so gradients
stay bitwise equal between the two (a tile's length changes the order of the sums, so a choice
that moved with free memory would not).

Measured (docs/results.md, 2026-11-29): the bench's CPU Llama at 2816 tokens, 4 groups and tiles of
512 ran x2.26 recompute's step; one group of one tile x1.10; its own forward, which fits half the
64 MiB budget there, as recompute+offload.
"""

from __future__ import annotations

import functools
import math
import types
from typing import NamedTuple

from ssdtrain.planner.plan_layer import block_working_bytes, layer_heads_moments

__all__ = ["LayerSizes", "group_choices", "sized_heads"]


class LayerSizes(NamedTuple):
    """What a layer takes at one length: ``whole`` (its own forward, untiled), else ``groups``
    groups of query heads and tiles of ``tile_tokens`` positions."""

    whole: bool
    tile_tokens: int
    groups: int


def group_choices(heads: int, kv_heads: int) -> tuple[int, ...]:
    """The numbers of groups a layer of ``heads`` query and ``kv_heads`` key/value heads can take
    (:func:`ssdtrain.longctx.head_groups.group_heads`): dividing the query heads, and a divisor or a
    multiple of the key/value heads; ascending."""
    return tuple(g for g in range(1, heads + 1) if heads % g == 0 and (kv_heads % g == 0 or g % kv_heads == 0))


@functools.lru_cache(maxsize=256)
def sized_heads(seq: int, batch: int, *, hidden: int, heads: int, kv_heads: int, ffn_hidden: int, dtype_bytes: int,
                memory: int, tile_tokens: int, head_groups: int, flash: bool = True) -> LayerSizes:
    """What a layer of ``seq`` positions whose backward may hold ``memory`` bytes takes: its own
    forward if the untiled layer fits (``flash``: attention keeps no scores); else the fewest
    groups (of :func:`group_choices`, at most ``head_groups``) where a tile of ``tile_tokens``
    positions or more fits, and the fewest tiles (the sequence in equal tiles, ``ceil(seq / n)``
    positions, so none is longer than fits); ``tile_tokens`` and ``head_groups`` where none fits."""
    for name, value in (("seq", seq), ("batch", batch), ("memory", memory), ("tile_tokens", tile_tokens),
                        ("head_groups", head_groups)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"sized_heads: {name} must be a positive int, got {value!r}")
    shape = dict(arch="llama", seq=seq, hidden=hidden, heads=heads, ffn_hidden=ffn_hidden, dtype_bytes=dtype_bytes,
                 kv_dim=hidden * kv_heads // heads, flash=flash)
    if block_working_bytes(types.SimpleNamespace(**shape, tile_tokens=seq), batch) <= memory:
        return LayerSizes(True, seq, 1)
    for groups in group_choices(heads, kv_heads):
        if groups > head_groups:
            break
        # every moment is linear in the tile: its bytes at no tile, and a position's
        at0 = layer_heads_moments(types.SimpleNamespace(**shape, tile_tokens=0, head_groups=groups), batch)
        at1 = layer_heads_moments(types.SimpleNamespace(**shape, tile_tokens=1, head_groups=groups), batch)
        longest = min((memory - at0[k]) // (at1[k] - at0[k]) if at1[k] > at0[k] else
                      (seq if memory >= at0[k] else 0) for k in at0)
        if longest >= min(seq, tile_tokens):  # one tile where the whole sequence fits
            return LayerSizes(False, math.ceil(seq / math.ceil(seq / longest)), groups)
    return LayerSizes(False, min(tile_tokens, seq), head_groups)
