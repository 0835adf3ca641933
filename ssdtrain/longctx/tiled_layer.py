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

import torch
from torch import nn

from ssdtrain.longctx._tiles import tiled_parts

__all__ = ["params_of", "tiled_parts"]


def params_of(*modules: nn.Module) -> tuple[torch.Tensor, ...]:
    """The parameters of ``modules`` that want gradients, each once (a tied weight too)."""
    seen: dict[int, torch.Tensor] = {}
    for m in modules:
        for p in m.parameters():
            if p.requires_grad:
                seen.setdefault(id(p), p)
    return tuple(seen.values())
