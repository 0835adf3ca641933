"""One block of ``ssdtrain plan``'s model (stated in ``plan.py``'s docstring): the bytes it saves for
backward, what its backward holds beyond them, its forward FLOPs and its parameters, from a model's
dimensions (``gpt``: Korthikanti et al.'s layer; ``llama``: RMSNorm, grouped-query attention, SwiGLU).
Pure Python, no torch; the functions that take ``inp`` read a :class:`~ssdtrain.planner.plan_inputs.Inputs`.
"""

from __future__ import annotations

__all__ = ["activation_bytes_per_layer", "block_working_bytes", "head_activation_bytes", "layer_forward_flops",
           "layer_params", "llama_activation_bytes_per_layer", "mlp_forward_flops"]


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


def block_working_bytes(inp, micro_batch: int = 1, *, tiled: bool = False) -> int:
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
    (``7df`` a token) exist for one tile of ``tile_tokens`` positions."""
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
