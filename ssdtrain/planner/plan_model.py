"""The memory and time model of ``ssdtrain plan`` (stated in ``plan.py``'s docstring), per pipeline
configuration: model states, what each mode keeps on the busier pipeline stage, the step's time, and
the fastest configuration that fits. Pure Python, no torch; it builds on one block's figures
(``plan_layer.py``) and the question asked (``plan_inputs.py``); ``plan_drive.py`` builds on it, and
``plan.py`` puts them together.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ssdtrain.planner.plan_inputs import Inputs
from ssdtrain.planner.plan_layer import (_backward_grad_bytes, block_working_bytes, head_activation_bytes,
                                         layer_forward_flops, layer_params)

__all__ = ["MODES", "Config", "best_config", "evaluate", "inflight_layers", "max_micro_batch", "model_state_bytes"]

MODES = ("baseline", "recompute", "offload")
RESERVE_FRACTION = 0.10
OFFLOAD_RESIDENT_LAYERS = 2
GIB = 1 << 30
MODES_TILED = ("recompute+tiled", "recompute+tiled-layer", "recompute+tiled-heads", "recompute+offload",
               "recompute+offload+tiled", "recompute+offload+tiled-layer", "recompute+offload+tiled-heads")
"""The long-context modes ``_stage_memory`` also knows (``plan_longctx.py``): ``+tiled`` the MLP run a
tile of ``tile_tokens`` positions at a time (``ssdtrain.longctx``); ``+tiled-layer`` every
position-wise part of the block so (``plan_layer.layer_tiled_moments``); ``+tiled-heads`` that and
attention a group of heads at a time (``plan_layer.layer_heads_moments``); ``+offload`` every block input
off the GPU (host tier, then drives) but ``CKPT_RESIDENT`` in flight."""
CKPT_RESIDENT = 1
"""Block inputs on the GPU under ``recompute+offload`` beside the recomputed block's own: the one
being copied out in forward, or read back ahead of its block in backward."""


def _divisors(n: int) -> list[int]:
    small = [i for i in range(1, math.isqrt(n) + 1) if n % i == 0]
    return sorted(set(small + [n // i for i in small]))


@dataclass(frozen=True)
class Config:
    """One evaluated (mode, stages, micro-batch) point."""

    mode: str
    stages: int
    data_parallel: int
    micro_batch: int
    num_microbatches: int
    bubble_fraction: float
    memory_gib: float
    step_time_s: float
    stall_s: float
    offload_fraction: float
    written_bytes_per_step: int
    required_write_gbps: float
    virtual_stages: int = 1


def model_params(inp) -> int:
    """All parameters: the blocks, the embeddings and the head (``llama``: untied, and the final
    RMSNorm; ``gpt``: learned positions, the head tied to the embedding unless ``tied_head`` is off)."""
    embed, head = _edges(inp, 1)
    return inp.layers * layer_params(inp) + embed + head


def _edges(inp, p: int) -> tuple[int, int]:
    """Parameters of the first stage's embeddings and of the last stage's head, at ``p`` stages
    (``gpt``'s tied head: none at one stage, a copy of the word embedding at more)."""
    h, v = inp.hidden, inp.vocab
    if inp.arch == "gpt":
        return (v + inp.seq) * h, (v * h if p > 1 or not inp.tied_head else 0)
    return v * h, v * h + h  # untied head and the final RMSNorm


def model_state_bytes(inp: Inputs, params: int, dp: int) -> float:
    """Bytes of model states per GPU for ``params`` parameters: weights (``d`` bytes each), and for
    the trained share their gradients (``d``) and optimizer state (``optimizer_bytes``; by default
    fp32 master weights and two AdamW moments: the rest of ``BYTES_PER_PARAM``), each divided over
    the ``dp`` data-parallel ranks as ``--zero`` shards it."""
    d = inp.dtype_bytes
    opt = inp.optimizer_gpu_bytes
    shard = [dp if inp.zero >= level else 1 for level in (3, 2, 1)]  # weights, gradients, optimizer
    per_param = d / shard[0] + inp.trainable_fraction * (d / shard[1] + opt / shard[2])
    return params * per_param


def inflight_layers(layers: int, p: int, m: int, v: int = 1) -> tuple[float, float]:
    """Layers' worth of one micro-batch's activations the first and the last of ``p`` stages hold
    at their peak, each stage ``layers`` layers in ``v`` chunks. Plain 1F1B (``v`` 1): the first
    stage runs ``p`` forwards before its first backward, the last one. Interleaved (Megatron-Core's
    schedule): a stage's warm-up is ``2(p - 1 - rank) + (v - 1)p`` chunk forwards, so the first stage
    holds ``2(p - 1) + (v - 1)p + 1`` chunks of ``layers / v`` layers, the last ``(v - 1)p + 1``; at
    most the ``m v`` chunk forwards there are."""
    if v == 1:
        return min(m, p) * layers, layers
    chunk = layers / v
    return min(m * v, 2 * (p - 1) + (v - 1) * p + 1) * chunk, min(m * v, (v - 1) * p + 1) * chunk


def _stage_memory(inp: Inputs, mode: str, p: int, b: int, m: int, offload_fraction: float = 1.0,
                  virtual: int = 1) -> float:
    """Peak bytes on the busier of the first and last pipeline stage: model states, what the mode
    keeps through the step (``first``/``last``: saves or checkpoints, of the micro-batches in flight:
    ``inflight_layers``, ``virtual`` chunks a stage), and what one block's backward adds (``work``: its
    gradients; under checkpointing the recomputed block, ``block_working_bytes``).

    The head's saves and one chunk's logits (``head_activation_bytes``) come on top of that for
    ``gpt`` (as the model always counted them). For ``llama`` the head's backward comes first and
    frees them before any block's backward: the last stage's peak is the larger of the head's
    moment (its saves and the gradient of its input, ``dsbh``) and a block's."""
    s, h, v, d = inp.seq, inp.hidden, inp.vocab, inp.dtype_bytes
    layers = math.ceil(inp.layers / p)
    first_units, last_units = inflight_layers(layers, p, m, virtual)
    act = inp.act_layer(b)
    ckpt = d * s * b * h  # one block's input: what checkpointing keeps
    # Llama's working set counts the recomputed block's input, which is one of the checkpoints: once.
    # (gpt: Korthikanti's layer counts its LayerNorm input too; kept as it was, counted twice.)
    # The layer-tiled working set counts it for both archs.
    heads = mode.endswith("+tiled-heads")
    layer = mode.endswith("+tiled-layer") or heads
    own_input = ckpt if inp.arch == "llama" or layer else 0
    if mode == "baseline":
        work = _backward_grad_bytes(inp, b)
        first_keep, last_keep = first_units * act, last_units * act
    elif mode in ("recompute", "recompute+tiled", "recompute+tiled-layer", "recompute+tiled-heads"):
        work = block_working_bytes(inp, b, tiled=mode == "recompute+tiled", layer=layer, heads=heads) - own_input
        first_keep, last_keep = first_units * ckpt, last_units * ckpt
    elif mode in ("recompute+offload", "recompute+offload+tiled", "recompute+offload+tiled-layer",
                  "recompute+offload+tiled-heads"):
        # Every block input leaves the GPU (host tier, then drives) but the ones in flight.
        work = block_working_bytes(inp, b, tiled=mode.endswith("+tiled"), layer=layer, heads=heads) - own_input
        first_keep = last_keep = min(layers, 1 + CKPT_RESIDENT) * ckpt
    elif mode == "offload":
        # A fraction f of the activations goes to the drive; the rest stays like baseline's.
        work = _backward_grad_bytes(inp, b)
        window = min(layers, OFFLOAD_RESIDENT_LAYERS) * act if offload_fraction > 0 else 0
        first_keep = (1 - offload_fraction) * first_units * act + window
        last_keep = (1 - offload_fraction) * last_units * act + window
    else:
        raise ValueError(f"unknown mode {mode!r}; choose one of {MODES + MODES_TILED}")
    head_act = head_activation_bytes(s, h, v, b, dtype_bytes=d, loss_chunk=inp.loss_chunk)
    last_peak = work + head_act if inp.arch == "gpt" else max(work, head_act + ckpt)
    embed, head = _edges(inp, p)
    dp = max(1, inp.gpus // p)
    block = layers * layer_params(inp)
    if p == 1:
        return model_state_bytes(inp, block + embed + head, dp) + first_keep + last_peak
    first = model_state_bytes(inp, block + embed, dp) + first_keep + work
    last = model_state_bytes(inp, block + head, dp) + last_keep + last_peak
    return max(first, last)


def _usable_bytes(inp: Inputs) -> float:
    return inp.gpu_mem_gib * GIB * (1 - RESERVE_FRACTION)


def _offload_fraction(inp: Inputs, p: int, b: int, m: int, virtual: int = 1) -> float:
    """Smallest share of the activations that must go to the drive for the stage to fit.

    0 if everything fits in memory (then nothing is written), 1 if even full offload does not
    fit (the caller rejects the point). Memory is linear in the fraction on each stage.
    """
    usable = _usable_bytes(inp)
    if _stage_memory(inp, "offload", p, b, m, 0.0, virtual) <= usable:
        return 0.0
    full = _stage_memory(inp, "offload", p, b, m, 1.0, virtual)
    if full > usable:
        return 1.0
    lo, hi = 0.0, 1.0  # memory(lo) > usable >= memory(hi)
    for _ in range(40):
        mid = (lo + hi) / 2
        if _stage_memory(inp, "offload", p, b, m, mid, virtual) <= usable:
            hi = mid
        else:
            lo = mid
    return hi


def evaluate(
    inp: Inputs, mode: str, p: int, b: int, *, offload_fraction: float | None = None, virtual: int = 1
) -> Config | None:
    """The point (mode, p stages of ``virtual`` chunks each, micro-batch b), or ``None`` if it is
    not a valid split (interleaving: more than one stage, each stage's layers a multiple of the
    chunks, the micro-batches a multiple of the stages, as Megatron-Core requires).

    For ``offload`` the point writes the smallest share of activations that makes it fit,
    unless ``offload_fraction`` forces one; memory is not checked here (see
    :func:`best_config`). A slot is one micro-batch's forward and backward on the slowest stage at
    ``inp.rate(b)``; a step is ``m + (p - 1)/v`` slots (the interleaved schedule's bubble is ``v``
    times shorter: its warm-up and drain run chunks of ``1/v`` of a stage).
    """
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of {MODES}")
    if inp.gpus % p or p > inp.layers:
        return None
    dp = inp.gpus // p
    if inp.global_batch % (dp * b):
        return None
    m = inp.global_batch // (dp * b)
    if virtual > 1 and (p == 1 or inp.layers % (p * virtual) or m % p):
        return None
    s, h, v = inp.seq, inp.hidden, inp.vocab
    layers = math.ceil(inp.layers / p)
    # The slowest stage: its layers plus the LM head (the last stage's share); backward twice the
    # forward's FLOPs, and under recompute the layers' forward again.
    blocks = layers * layer_forward_flops(inp)
    forward = blocks + 2 * s * h * v
    again = blocks if mode == "recompute" else 0
    slot = b * ((forward + again) / inp.rate(b) + 2 * forward / inp.backward_rate(b)) / 1e12
    fraction = 0.0
    written = 0
    required = 0.0
    stall = 0.0
    if mode == "offload":
        fraction = _offload_fraction(inp, p, b, m, virtual) if offload_fraction is None else offload_fraction
        per_mb = fraction * layers * inp.act_layer(b)
        written = int(per_mb * m)
        required = per_mb / slot / 1e9
        stall = m * max(0.0, per_mb / (inp.drive_gbps * inp.drives * 1e9) - slot)
    allreduce = _allreduce_s(inp, p, dp)
    return Config(
        mode=mode,
        stages=p,
        data_parallel=dp,
        micro_batch=b,
        num_microbatches=m,
        bubble_fraction=(p - 1) / (virtual * m + p - 1),
        memory_gib=_stage_memory(inp, mode, p, b, m, fraction, virtual) / GIB,
        step_time_s=(m + (p - 1) / virtual) * slot + stall + allreduce,
        stall_s=stall,
        offload_fraction=fraction,
        written_bytes_per_step=written,
        required_write_gbps=required,
        virtual_stages=virtual,
    )


def _allreduce_s(inp: Inputs, p: int, dp: int) -> float:
    """Seconds of the data-parallel gradient all-reduce of the larger stage (ring: ``2 (dp - 1)/dp``
    of its trained parameters' gradients over ``inp.allreduce_gbps``); 0 when it is not modelled."""
    if dp == 1 or not inp.allreduce_gbps:
        return 0.0
    embed, head = _edges(inp, p)
    params = math.ceil(inp.layers / p) * layer_params(inp) + (embed + head if p == 1 else max(embed, head))
    return 2 * (dp - 1) / dp * params * inp.trainable_fraction * inp.dtype_bytes / (inp.allreduce_gbps * 1e9)


def _stage_counts(inp: Inputs) -> list[int]:
    if inp.stages is not None:
        return [inp.stages]
    return [p for p in range(1, min(inp.gpus, inp.layers) + 1) if inp.gpus % p == 0]


def max_micro_batch(inp: Inputs, mode: str, p: int) -> int:
    """Largest micro-batch whose 1F1B peak (p micro-batches in flight) fits at p stages; 0 if none."""
    usable = _usable_bytes(inp)
    if _stage_memory(inp, mode, p, 1, p) > usable:
        return 0
    lo, hi = 1, 2
    while _stage_memory(inp, mode, p, hi, p) <= usable:
        lo, hi = hi, hi * 2
        if hi > 1 << 40:
            return lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _stage_memory(inp, mode, p, mid, p) <= usable:
            lo = mid
        else:
            hi = mid
    return lo


def best_config(inp: Inputs, mode: str) -> Config | None:
    """Fastest fitting configuration for the global batch (ties: fewer stages, fewer chunks a stage,
    larger micro-batch); interleaved ones too where ``inp.virtual_stages`` allows them."""
    usable_gib = _usable_bytes(inp) / GIB
    best = None
    for p in _stage_counts(inp):
        dp = inp.gpus // p
        if inp.global_batch % dp:
            continue
        per_replica = inp.global_batch // dp
        for b in _divisors(per_replica):
            for virtual in sorted({1, inp.virtual_stages}):
                cfg = evaluate(inp, mode, p, b, virtual=virtual)
                if cfg is None or cfg.memory_gib > usable_gib:
                    continue
                key = (float(f"{cfg.step_time_s:.9g}"), cfg.stages, virtual, -cfg.micro_batch)
                if best is None or key < best[0]:
                    best = (key, cfg)
    return None if best is None else best[1]
