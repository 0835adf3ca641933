"""One block of ``ssdtrain plan``'s model (stated in ``plan.py``'s docstring): the bytes it saves for
backward, what its backward holds beyond them, its forward FLOPs and its parameters, from a model's
dimensions (``gpt``: Korthikanti et al.'s layer; ``llama``: RMSNorm, grouped-query attention, SwiGLU).
Pure Python, no torch; the functions that take ``inp`` read a :class:`~ssdtrain.planner.plan_inputs.Inputs`.
"""

from __future__ import annotations

__all__ = ["activation_bytes_per_layer", "attention_forward_flops", "block_working_bytes", "head_activation_bytes", "layer_forward_flops",
           "layer_heads_moments", "layer_params", "layer_tiled_moments", "llama_activation_bytes_per_layer", "mlp_forward_flops",
           "position_wise_forward_flops", "qkv_forward_flops"]


def activation_bytes_per_layer(
    seq: int,
    hidden: int,
    heads: int,
    micro_batch: int = 1,
    *,
    dtype_bytes: int = 2,
    flash: bool = False,
    dropout: bool = True,
) -> int:
    """Bytes one transformer layer saves for backward (no tensor parallelism, no recompute).

    With ``dtype_bytes=2, dropout=True, flash=False`` this is Korthikanti et al.'s
    ``sbh(34 + 5as/h)``; ``flash=True`` drops the s² term. See ``plan.py``'s docstring for the
    generalisation to other dtypes and to no dropout.
    """
    s, b, h, a, d = seq, micro_batch, hidden, heads, dtype_bytes
    sbh = s * b * h
    total = sbh * (16 * d + (2 if dropout else 0))
    if not flash:
        total += a * s * s * b * (d + ((1 + d) if dropout else 0))
    return total


def head_activation_bytes(seq: int, hidden: int, vocab: int, micro_batch: int = 1, *, dtype_bytes: int = 2,
                          loss_chunk: int = 0) -> int:
    """Bytes saved around the LM head: final LayerNorm and head inputs, fp32 log-softmax (4sbV; with a
    chunked loss, one chunk's: 4 x chunk x V)."""
    sb = seq * micro_batch
    logits = min(sb, loss_chunk) if loss_chunk else sb
    return 4 * logits * vocab + 2 * dtype_bytes * sb * hidden


def llama_activation_bytes_per_layer(seq: int, hidden: int, heads: int, kv_heads: int, ffn_hidden: int,
                                     micro_batch: int = 1, *, dtype_bytes: int = 2, flash: bool = True) -> int:
    """Bytes one Llama block saves for backward (no recompute, no dropout): per token, ``d`` bytes
    each of the attention half's input (the block input: RMSNorm's), its normed copy (the q/k/v
    projections' input), q, k and v (grouped-query: k and v ``kv = hidden x kv_heads / heads`` wide,
    after RoPE, which saves nothing of size) and the attention output (the o-projection's input),
    the MLP half's input (RMSNorm's) and normed copy (gate's and up's input), and the SwiGLU's
    gate, ``silu(gate)``, up and their product (the down projection's input), ``ffn_hidden`` wide
    each, as eager PyTorch saves them (a fused SwiGLU saves 3 of the 4); plus fp32 RMSNorm ``rstd``
    (2 x 4 bytes) and flash attention's log-sum-exp (4 bytes a head):
    ``sb(d(6h + 2kv + 4f) + 4a + 8)``. Without flash attention (eager, SDPA's math path) the
    softmax output ``as²b`` at ``d`` bytes more. For Llama-3.1-8B in bf16: 168,072 bytes a token."""
    s, b, h, a, f, d = seq, micro_batch, hidden, heads, ffn_hidden, dtype_bytes
    kv = h * kv_heads // heads
    total = s * b * (d * (6 * h + 2 * kv + 4 * f) + 4 * a + 8)
    if not flash:
        total += a * s * s * b * d
    return total


def block_working_bytes(inp, micro_batch: int = 1, *, tiled: bool = False, layer: bool = False,
                        heads: bool = False) -> int:
    """Peak bytes of the block that backward recomputes under checkpointing (its input included):
    recompute's working set on top of the checkpoints.

    ``gpt``: one layer's activations, Korthikanti's count (as before); tiled, the MLP's GELU input
    and second input (4h each, ``8dh`` a token) for ``tile_tokens`` positions only.

    ``llama``: the larger of two moments of its backward. In the MLP's: every save of the block
    (:func:`llama_activation_bytes_per_layer`), the residual stream's gradient and the MLP input's
    (``2dh`` a token) and the SwiGLU's gradients (product, then up and ``silu(gate)``, then gate: at
    most 3 alive, ``3df``). In the attention's (the MLP's saves freed): the attention half's saves,
    the gradients of the residual, of the attention output and of q, k, v (``d(3h + 2kv)``) and
    FlashAttention-2's fp32 accumulator of dq (``4h``). Tiled, the SwiGLU's saves and gradients
    (``7df`` a token) exist for one tile of ``tile_tokens`` positions.

    ``layer=True``: the whole layer tiled (``recompute+tiled-layer``), both archs: the largest of
    :func:`layer_tiled_moments` (``gpt``: Korthikanti's count with the position-wise saves for one tile).
    ``heads=True`` (``llama``): that, and attention a group of heads at a time
    (``recompute+tiled-heads``): the largest of :func:`layer_heads_moments`."""
    if heads and inp.arch == "llama":
        return max(layer_heads_moments(inp, micro_batch).values())
    if layer or heads:
        return max(layer_tiled_moments(inp, micro_batch).values())
    s, b, h, d = inp.seq, micro_batch, inp.hidden, inp.dtype_bytes
    t = min(s, inp.tile_tokens) if tiled else s
    if inp.arch == "gpt":
        inner = 8 * d * h
        return inp.act_layer(b) - s * b * inner + t * b * inner
    a, kv, f = inp.heads, inp.kv_dim, inp.ffn_hidden
    sb = s * b
    scores = 0 if inp.flash else a * s * s * b * d
    attn_saves = sb * (d * (4 * h + 2 * kv) + 4 * a + 4) + scores
    mlp_saves = sb * (2 * d * h + 4)
    mlp_peak = attn_saves + mlp_saves + sb * 2 * d * h + t * b * 7 * d * f
    attn_peak = attn_saves + sb * (d * (3 * h + 2 * kv) + 4 * h) + scores
    return max(mlp_peak, attn_peak)


def layer_tiled_moments(inp, micro_batch: int = 1) -> dict[str, int]:
    """Bytes the recomputed block holds when the whole layer is tiled (``ssdtrain.longctx.tiled_layer``):
    its position-wise parts run ``t = tile_tokens`` positions at a time, forward and backward (each
    tile recomputed in backward), in two tiled functions: the norm, q/k/v projections and RoPE
    (``pre``: of the block input ``x``, giving q, k, v), and the o-projection, residual, norm, MLP and
    residual (``post``: of ``x`` and the attention output, giving the block output). Attention runs
    over the whole sequence between them.

    Per token, ``d`` bytes an element, ``kv`` the width of k and of v, ``a`` heads. ``llama``: three
    moments of its backward, with the gradients alive at each (as the untiled count has them):

    * ``whole``: the tensors of the whole sequence the block keeps through its backward: ``x``, q, k,
      v and the attention output, ``d(3h + 2kv)``, and attention's fp32 log-sum-exp ``4a`` (without
      flash attention, its softmax output ``as²d`` instead, as the untiled count has it).
    * ``mlp``: ``post``'s backward: ``whole``, the incoming gradient of the block output and the
      gradients it writes for the attention output and for ``x`` (``3dh``), and one tile's: the
      residual sum, its normed copy and the tile's output (``3dh``), SwiGLU's gate, ``silu(gate)``,
      up, product and 3 gradients (``7df``) and RMSNorm's fp32 ``rstd`` (4).
    * ``attention``: attention's backward (the gradient of the block output freed): ``whole``, the
      gradients of the attention output and of ``x`` (``post``'s), the gradients of q, k and v
      (``d(3h + 2kv)`` with them), FlashAttention-2's fp32 dq accumulator ``4h`` and its fp32
      ``rowsum(dO o O)`` ``4a``. Without flash attention: the softmax's gradient ``as²d`` instead of
      the accumulator and that row sum.
    * ``qkv``: ``pre``'s backward (attention's saves freed): ``x``, ``post``'s gradient of ``x``,
      the gradients of q, k, v and ``pre``'s gradient of ``x``, ``d(4h + 2kv)``, and one tile's
      normed copy and its gradient, q, k, v before RoPE and their gradients, ``d(4h + 4kv)``, and
      ``rstd``.

    For Llama-3.1-8B in bf16 the peak is ``attention``'s: 73,984 bytes a token (``d(6h + 4kv) + 4h +
    8a``, ``9.03 x shd``), against 82,052 with the MLP alone tiled (the same moment, which also holds
    the normed copy of ``x`` and its fp32 ``rstd``) and 270,472 untiled (the MLP's moment).

    ``gpt`` (``kv = h``), in Korthikanti's count as its untiled block (the saves, no gradients):
    ``whole``, the saves of the whole sequence, ``x``, q, k, v and the projection's input ``5dh``
    (without flash attention and the softmax's ``as²`` saves: output, dropout mask and dropped copy);
    ``layer``: ``whole`` and one tile's position-wise saves, the QKV input, the second LayerNorm's
    input, the MLP's input, GELU's input and the second linear's input ``d(3h + 2f)``, and two 1-byte
    dropout masks ``2h``.

    The whole-sequence part grows with ``s`` (``s²`` terms only without flash attention); the tiles'
    with ``t`` alone. Not counted, here as in the untiled count: the dk and dv FlashAttention-2 writes
    for every query head under grouped-query attention before summing them over the group (``2dh``
    more at ``attention``); the recomputation's forward, which holds less (``whole``, the block output
    and the incoming gradient, one forward tile), and the checkpointed forward."""
    s, b, h, d, a, f = inp.seq, micro_batch, inp.hidden, inp.dtype_bytes, inp.heads, inp.ffn_hidden
    t = min(s, inp.tile_tokens)
    sb, tb = s * b, t * b
    if inp.arch == "gpt":
        scores = 0 if inp.flash else a * s * s * b * (d + ((1 + d) if inp.dropout else 0))
        whole = sb * 5 * d * h + scores
        return {"whole": whole, "layer": whole + tb * (d * (3 * h + 2 * f) + (2 * h if inp.dropout else 0))}
    kv = inp.kv_dim
    if inp.flash:
        kept, attn_grad = sb * 4 * a, sb * (4 * h + 4 * a)
    else:
        kept = attn_grad = a * s * s * b * d
    whole = sb * d * (3 * h + 2 * kv) + kept
    return {
        "whole": whole,
        "mlp": whole + sb * 3 * d * h + tb * (d * (3 * h + 7 * f) + 4),
        "attention": whole + sb * d * (3 * h + 2 * kv) + attn_grad,
        "qkv": sb * d * (4 * h + 2 * kv) + tb * (d * (4 * h + 4 * kv) + 4),
    }


def layer_heads_moments(inp, micro_batch: int = 1) -> dict[str, int]:
    """Bytes the recomputed ``llama`` block holds when the whole layer is tiled and attention runs a
    group of query heads at a time (``ssdtrain.longctx.head_groups.grouped_layer``): ``G =
    inp.head_groups`` groups (by default one per key/value head), a group's q ``hq = h/G`` wide, its
    k and v ``kvg = max(kv/G, h/heads)`` (with more groups than key/value heads, one head each).
    The layer is one Function; it keeps of the whole sequence the block input ``x``, attention's
    output ``y`` and its fp32 log-sum-exp (``4a``), and in backward the incoming gradient of the
    block output, the input's gradient (one buffer both branches write) and ``y``'s (``5dh + 4a``
    a token at every backward moment). Beside that, the largest of:

    * ``post``: the o-projection, residuals, norm and MLP again a tile at a time with a graph: one
      tile's tensors and gradients as :func:`layer_tiled_moments`' ``mlp`` has them
      (``d(3h + 7f) + 4``);
    * ``attention``: one group's q, k and v (``d(hq + 2kvg)``), each key/value head repeated for the
      group's query heads as a kernel without grouped-query support wants them (``2dhq``; the CPU
      kernel path passes an expanded view instead, so this is an upper bound there), the gradients
      of q and of the repeated k and v (``3dhq``: a kernel writes k's and v's for every query head)
      and of k and v folded (``2dkvg``), the group's rows of ``y``'s gradient copied dense (``dhq``)
      and the fp32 dq accumulator (``4hq``): ``d(7hq + 4kvg) + 4hq``
      a token, and one tile of the part replayed (the normed copy, q, k, v and their gradients,
      ``2d(h + hq + 2kvg)``).

    For Llama-3.1-8B in bf16: 51,404 bytes a token at ``attention`` with ``G = 8``, 44,492 with
    ``G = 32`` (a head at a time), against 73,984 with the layer tiled and attention whole."""
    s, b, h, d, a, f = inp.seq, micro_batch, inp.hidden, inp.dtype_bytes, inp.heads, inp.ffn_hidden
    t = min(s, inp.tile_tokens)
    sb, tb = s * b, t * b
    groups = inp.head_groups
    hq, kvg = h // groups, max(inp.kv_dim // groups, h // a)
    whole = sb * (5 * d * h + 4 * a)
    return {
        "post": whole + tb * (d * (3 * h + 7 * f) + 4),
        "attention": whole + sb * (d * (7 * hq + 4 * kvg) + 4 * hq) + tb * 2 * d * (h + hq + 2 * kvg),
    }


def _backward_grad_bytes(inp, micro_batch: int) -> int:
    """Gradients alive in one block's backward beyond its saves, without recompute: 0 for ``gpt``
    (Korthikanti's count, as before); for ``llama`` the larger of the MLP's ``d(2h + 3f)`` and the
    attention's ``d(3h + 2kv) + 4h`` a token (:func:`block_working_bytes`)."""
    if inp.arch == "gpt":
        return 0
    sb, h, d = inp.seq * micro_batch, inp.hidden, inp.dtype_bytes
    return sb * max(d * (2 * h + 3 * inp.ffn_hidden), d * (3 * h + 2 * inp.kv_dim) + 4 * h)


def layer_forward_flops(inp, seq: int | None = None) -> float:
    """Forward FLOPs of one block for one sequence. ``gpt``: ``24sh² + 4s²h`` (Megatron's count,
    attention over the whole square). ``llama``: its matrix products, ``2sh(2h + 2kv + 3f)``, and
    causal attention, ``2s²h`` (QKᵀ and AV over the lower triangle, which a causal flash kernel
    computes: half the square)."""
    s = inp.seq if seq is None else seq
    h = inp.hidden
    if inp.arch == "gpt":
        return 24.0 * s * h * h + 4.0 * s * s * h
    return 2.0 * s * h * (2 * h + 2 * inp.kv_dim + 3 * inp.ffn_hidden) + 2.0 * s * s * h


def mlp_forward_flops(inp, seq: int | None = None) -> float:
    """Forward FLOPs of one block's MLP (``gpt``: ``16sh²``; ``llama``: ``6shf``): what a tiled MLP
    runs once more under checkpointing (its backward recomputes each tile)."""
    s = inp.seq if seq is None else seq
    return 16.0 * s * inp.hidden ** 2 if inp.arch == "gpt" else 6.0 * s * inp.hidden * inp.ffn_hidden


def position_wise_forward_flops(inp, seq: int | None = None) -> float:
    """Forward FLOPs of one block but attention's ``s²`` part (``gpt``: ``24sh²``; ``llama``:
    ``2sh(2h + 2kv + 3f)``): what a tiled layer runs once more under checkpointing (its backward
    recomputes each tile of its position-wise parts; attention is not tiled)."""
    s = inp.seq if seq is None else seq
    h = inp.hidden
    if inp.arch == "gpt":
        return 24.0 * s * h * h
    return 2.0 * s * h * (2 * h + 2 * inp.kv_dim + 3 * inp.ffn_hidden)


def qkv_forward_flops(inp, seq: int | None = None) -> float:
    """Forward FLOPs of one ``llama`` block's q/k/v projections, ``2sh(h + 2kv)`` (``gpt``: ``6sh²``)."""
    s = inp.seq if seq is None else seq
    h = inp.hidden
    return 6.0 * s * h * h if inp.arch == "gpt" else 2.0 * s * h * (h + 2 * inp.kv_dim)


def attention_forward_flops(inp, seq: int | None = None) -> float:
    """Forward FLOPs of one block's attention over the sequence (:func:`layer_forward_flops`' ``s²``
    part: ``gpt`` ``4s²h``, ``llama`` causal ``2s²h``)."""
    s = inp.seq if seq is None else seq
    return (4.0 if inp.arch == "gpt" else 2.0) * s * s * inp.hidden


def _layer_params(h: int) -> int:
    # QKV 3h² + 3h, projection h² + h, MLP 8h² + 5h, two LayerNorms 4h.
    return 12 * h * h + 13 * h


def layer_params(inp) -> int:
    """Parameters of one block: ``gpt`` as :func:`_layer_params`; ``llama``: q and o ``2h²``, k and v
    ``2h·kv``, gate, up and down ``3hf``, two RMSNorms ``2h``, no biases."""
    h = inp.hidden
    if inp.arch == "gpt":
        return _layer_params(h)
    return 2 * h * h + 2 * h * inp.kv_dim + 3 * h * inp.ffn_hidden + 2 * h
