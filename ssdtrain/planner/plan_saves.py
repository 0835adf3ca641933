"""A micro-batch's saves in time, for ``ssdtrain plan``'s drive-limited model (``plan_drive.py``):
each tensor forward saves for backward, in pack order, with when forward packs it and when backward
first needs it, from the model's dimensions and the achieved compute rate (the offloader's view of a
step: ``ssdtrain/engine/offloader.py``). ``plan_simulate.py`` then plays the drive's rules on them.

* **Saves**, per layer in pack order, the 16 tensors of Korthikanti et al. (``plan.py``'s
  formula): LayerNorm input, QKV input, Q/K/V (one storage), [the s x s attention tensors with
  naive attention], projection input, [dropout mask], LayerNorm input, MLP input, GELU input
  (4 sbh), second MLP input (4 sbh), [dropout mask]; then the head: final LayerNorm input, head
  input, the fp32 log-softmax (4 sbV) and the targets. The token ids come first. With
  checkpointing a layer saves only its input (d sbh). Saves under ``min_bytes`` stay in memory.
* **Time** is proportional to FLOPs: forward per sequence QKV 6sh^2, attention 4s^2h, projection
  2sh^2, MLP 8sh^2 + 8sh^2, head 2shV, at ``tflops``; each op's backward is twice its FLOPs at
  ``backward_tflops``; LayerNorm, GELU, softmax and the loss take no time. A save is packed
  when its op runs forward and needed when that op's backward starts. With checkpointing a
  layer's backward first recomputes its forward, and needs its input when that recomputation
  starts.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Save", "forward_flops", "saves"]


@dataclass(frozen=True)
class Save:
    """One saved tensor: its bytes, when forward packs it and when backward first needs it
    (seconds from the start of forward and of backward)."""

    nbytes: int
    packed_s: float
    needed_s: float


def _layer_ops(s: int, h: int, a: int, d: int, flash: bool, dropout: bool, *, arch: str = "gpt",
               kv_heads: int | None = None, ffn_hidden: int | None = None) -> list[tuple[float, int]]:
    """One transformer layer's ops in forward order: (forward FLOPs, bytes it saves), per sequence.

    ``arch="llama"``: RMSNorm (input, rstd), the q/k/v projections (their input), attention (q, k,
    v, output, log-sum-exp; the softmax output without flash), the o-projection (its input is the
    attention's output: nothing more), RMSNorm, gate and up (their input), SiLU (the gate), the
    product (``silu(gate)`` and up), the down projection (the product): ``plan_layer``'s
    :func:`~ssdtrain.planner.plan_layer.llama_activation_bytes_per_layer` and
    :func:`~ssdtrain.planner.plan_layer.layer_forward_flops` op by op."""
    sh = s * h
    if arch == "llama":
        kv = h * (kv_heads or a) // a
        f = ffn_hidden or -(-8 * h // 3 // 256) * 256
        attn = d * s * (h + 2 * kv) + d * sh + 4 * a * s + (0 if flash else a * s * s * d)
        return [(0.0, d * sh + 4 * s), (2.0 * sh * (h + 2 * kv), d * sh), (2.0 * s * sh, attn),
                (2.0 * sh * h, 0), (0.0, d * sh + 4 * s), (4.0 * sh * f, d * sh), (0.0, d * s * f),
                (0.0, 2 * d * s * f), (2.0 * sh * f, d * s * f)]
    attn_saves = 3 * d * sh
    if not flash:
        attn_saves += a * s * s * (d + ((1 + d) if dropout else 0))
    ops = [(0.0, d * sh), (6.0 * sh * h, d * sh), (4.0 * s * sh, attn_saves), (2.0 * sh * h, d * sh)]
    if dropout:
        ops.append((0.0, sh))
    ops += [(0.0, d * sh), (8.0 * sh * h, d * sh), (0.0, 4 * d * sh), (8.0 * sh * h, 4 * d * sh)]
    if dropout:
        ops.append((0.0, sh))
    return ops


def forward_flops(*, layers: int, seq: int, hidden: int, vocab: int, micro_batch: int = 1, head: bool = True,
                  arch: str = "gpt", heads: int = 1, kv_heads: int | None = None,
                  ffn_hidden: int | None = None) -> float:
    """Forward FLOPs of one micro-batch: ``b(L(24sh^2 + 4s^2h) + 2shV)``, the head's term if ``head``
    (``arch="llama"``: ``2sh(2h + 2kv + 3f) + 2s^2h`` a layer, ``kv = hidden x kv_heads / heads``);
    divide by measured forward seconds for the compute rate ``--tflops`` wants (x 1e-12)."""
    s, h = seq, hidden
    if arch == "llama":
        kv = h * (kv_heads or heads) // heads
        f = ffn_hidden or -(-8 * h // 3 // 256) * 256
        layer = 2.0 * s * h * (2 * h + 2 * kv + 3 * f) + 2.0 * s * s * h
    else:
        layer = 24.0 * s * h * h + 4.0 * s * s * h
    return micro_batch * (layers * layer + (2.0 * s * h * vocab if head else 0.0))


def saves(*, layers: int, seq: int, hidden: int, heads: int, vocab: int, micro_batch: int,
          dtype_bytes: int, flash: bool, dropout: bool, checkpoint: bool, head: bool,
          tflops: float, backward_tflops: float, arch: str = "gpt", kv_heads: int | None = None,
          ffn_hidden: int | None = None) -> tuple[list[Save], float, float]:
    """The saves of one micro-batch's forward through ``layers`` layers (and the head, if
    ``head``), in pack order, with forward's and backward's seconds (backward includes the
    recomputation under ``checkpoint``). ``arch``, ``kv_heads``, ``ffn_hidden``: :func:`_layer_ops`."""
    s, h, b, d = seq, hidden, micro_batch, dtype_bytes
    fwd = b / (tflops * 1e12)           # seconds per forward FLOP of one sequence
    bwd = 2 * b / (backward_tflops * 1e12)  # seconds of backward per forward FLOP
    ops = _layer_ops(s, h, heads, d, flash, dropout, arch=arch, kv_heads=kv_heads, ffn_hidden=ffn_hidden)
    layer_flops = sum(f for f, _ in ops)
    # (bytes, forward seconds of the op that saves it, backward seconds of that op); ``extra``: the
    # seconds backward spends before that op's own backward (recomputing a checkpointed layer).
    plan: list[tuple[int, float, float]] = [(8 * s * b, 0.0, 0.0)]  # the token ids
    extra: list[float] = [0.0]
    for _ in range(layers):
        if checkpoint:
            plan.append((d * s * b * h, layer_flops * fwd, layer_flops * bwd))
            extra.append(layer_flops * fwd)  # its backward recomputes the layer first
            continue
        for flops, nbytes in ops:
            plan.append((nbytes * b, flops * fwd, flops * bwd))
            extra.append(0.0)
    if head:
        head_flops = 2.0 * s * h * vocab
        plan += [(d * s * b * h, 0.0, 0.0), (d * s * b * h, head_flops * fwd, head_flops * bwd),
                 (4 * s * b * vocab, 0.0, 0.0), (8 * s * b, 0.0, 0.0)]
        extra += [0.0] * 4
    # Forward: an op packs its saves when it starts. Backward runs the ops in reverse; each needs
    # its saves when its backward (after any recomputation) starts.
    packed, t = [], 0.0
    for _, fsec, _ in plan:
        packed.append(t)
        t += fsec
    forward_s = t
    needed = [0.0] * len(plan)
    t = 0.0
    for i in range(len(plan) - 1, -1, -1):
        needed[i] = t
        t += extra[i] + plan[i][2]
    return [Save(n, p, u) for (n, _, _), p, u in zip(plan, packed, needed)], forward_s, t
