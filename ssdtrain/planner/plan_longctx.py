"""The long-context section of ``ssdtrain plan``: each mode's longest sequence on one GPU, and for
the offload modes the host memory, the drive space and the drive rate that sequence needs.

Modes (micro-batch 1, ``inp.stages or 1`` stages, memory from ``plan_model._stage_memory``):

* ``baseline``: every block's saves stay (``Inputs.act_layer``), plus one block's gradients.
* ``recompute``: checkpointing per block keeps each block's input (``L x s x hidden x d`` bytes:
  256 KiB a token for Llama-3.1-8B in bf16), plus the working set of the block that backward
  recomputes (``plan_layer.block_working_bytes``).
* ``recompute+tiled``: the same with the MLP tiled (``ssdtrain.longctx``): its intermediates exist
  for ``tile_tokens`` positions at a time.
* ``recompute+tiled-layer``: the same with every position-wise part of the block tiled
  (``ssdtrain.longctx.tiled_layer``): the norm, q/k/v projections and RoPE, and the o-projection,
  residuals, norm and MLP, each a tile at a time; attention runs over the whole sequence. The
  recomputed block keeps of the whole sequence only its input, q, k, v, the attention output, the
  log-sum-exp and in backward their gradients (``plan_layer.layer_tiled_moments``): its peak is
  attention's backward, as with the MLP alone tiled, less the normed copy of the input.
* ``recompute+tiled-heads``: the same with attention a group of query heads (one key/value head's)
  at a time (``ssdtrain.longctx.head_groups``): of the whole sequence the recomputed block keeps its
  input, attention's output and log-sum-exp, and in backward three gradients
  (``plan_layer.layer_heads_moments``); q, k, v and their gradients exist for one group at a time.
* ``recompute+offload`` (``+tiled``, ``+tiled-layer``, ``+tiled-heads``): the block inputs leave the GPU (ssdtrain, ``min_bytes=0``):
  to the host tier while its share holds them, to the drives beyond it. The GPU keeps the
  recomputed block's input and ``CKPT_RESIDENT`` more in flight. Its longest sequence is what GPU
  memory allows, whatever the host holds (the drives take the rest): ``host_alone_seq`` is the
  longest the host share holds by itself.

Every mode has the same model states (weights, and for the trained share gradients and optimizer
state: ``--optimizer``), the head's saves and one chunk of the loss's logits (``--loss-chunk``), and
10% of GPU memory reserved (``RESERVE_FRACTION``).

Time (what the drive figures rest on): a block's forward FLOPs (``plan_layer.layer_forward_flops``)
and the head's ``2shV`` at ``--tflops``; backward is twice forward's FLOPs at ``--backward-tflops``
(default ``--tflops``), plus what it recomputes at ``--tflops``: the blocks under checkpointing, the
tiled MLPs once more (each tile is recomputed in the tiled MLP's backward) and the head under a
chunked loss (each chunk is checkpointed); ``+tiled-layer``: the blocks' position-wise parts once
more instead of the MLPs (``plan_layer.position_wise_forward_flops``: all but attention's ``s²``
part); ``+tiled-heads``: that, the q/k/v projections once more (each group's made again in backward
before its part is replayed) and, on a GPU, attention's forward once more (the CUDA path takes a
group's gradients by running its attention again: ``ssdtrain.longctx.head_groups``' recompute path;
the kernel path, which does not, runs on the CPU only so far). Copies and I/O are assumed to overlap compute.

Drive figures for the offload modes, at the longest sequence:

* ``nvme_bytes``: the block inputs beyond the host share (``checkpoint_bytes - host share``).
* ``drive_gbps_free``: the rate at which that spill costs nothing: written during forward and read
  back during backward, ``nvme_bytes / min(T_forward, T_backward)``. That is the tier spilling its
  oldest entries (the first blocks' inputs, needed last) to the drives over the whole forward.
* ``drive_gbps_free_today``: the offloader as it is: the saves the tier has no room for (the last
  blocks' inputs, whole) go straight to the drives, each written before forward ends, so the
  drive writes ``spilled_today_bytes`` between the first of them and forward's end.
* ``host_link_gbps``: the copy rate to the host each block input needs: one block input per
  block's forward.

Under 1F1B (``--stages``) the GPU holds the block inputs of its micro-batches in flight (host and
drive bytes count them all; the rates are per micro-batch, each spilling during its own forward).
Not modelled: LoRA's dropout (``lora_dropout > 0`` saves a dropped copy of each adapted layer's
input), ZeRO-3's gathered weights, the read-ahead window (``prefetch_bytes``) holding a block's
input back in backward, and the caching allocator beyond the 10% reserve.
"""

from __future__ import annotations

import math
from dataclasses import replace

from ssdtrain.planner.plan_layer import (attention_forward_flops, layer_forward_flops, mlp_forward_flops,
                                        position_wise_forward_flops, qkv_forward_flops)
from ssdtrain.planner.plan_model import GIB, _stage_memory, _usable_bytes, model_params, model_state_bytes

__all__ = ["LONGCTX_MODES", "OFFLOAD_MODES", "format_long_context", "long_context", "step_seconds"]

LONGCTX_MODES = ("baseline", "recompute", "recompute+tiled", "recompute+tiled-layer", "recompute+tiled-heads",
                 "recompute+offload", "recompute+offload+tiled", "recompute+offload+tiled-layer",
                 "recompute+offload+tiled-heads")
OFFLOAD_MODES = ("recompute+offload", "recompute+offload+tiled", "recompute+offload+tiled-layer",
                 "recompute+offload+tiled-heads")
_SEQ_STEP = 256  # sequence lengths are searched in multiples of this
_SEQ_CAP = 1 << 24


def _shape(inp) -> tuple[int, int, int]:
    """(stages, micro-batches in flight, layers on the stage) of the section's one GPU."""
    p = inp.stages or 1
    m = max(1, inp.global_batch // max(1, inp.gpus // p))
    return p, min(m, p), math.ceil(inp.layers / p)


def _memory(inp, mode: str, seq: int) -> float:
    p = inp.stages or 1
    m = max(1, inp.global_batch // max(1, inp.gpus // p))
    return _stage_memory(replace(inp, seq=seq), mode, p, 1, m)


def _longest(inp, mode: str, usable: float) -> tuple[int | None, bool]:
    """The longest sequence (a multiple of 256) that fits ``usable`` bytes; whether the search capped."""
    if _memory(inp, mode, _SEQ_STEP) > usable:
        return None, False
    lo, hi = _SEQ_STEP, 2 * _SEQ_STEP
    while hi <= _SEQ_CAP and _memory(inp, mode, hi) <= usable:
        lo, hi = hi, 2 * hi
    capped = hi > _SEQ_CAP
    while hi - lo > _SEQ_STEP:
        mid = (lo + hi) // 2 // _SEQ_STEP * _SEQ_STEP
        lo, hi = (mid, hi) if _memory(inp, mode, mid) <= usable else (lo, mid)
    return lo, capped


def step_seconds(inp, mode: str, seq: int) -> dict:
    """Forward's and backward's seconds for one sequence of ``seq`` tokens on the section's GPU (the
    module docstring's time model), and one block's forward and the head's."""
    p, _, layers = _shape(inp)
    one = replace(inp, seq=seq)
    block = layer_forward_flops(one)
    head = 2.0 * seq * inp.hidden * inp.vocab if p == 1 else 0.0
    forward = layers * block + head
    again = 0.0
    if mode != "baseline":
        again += layers * block
    if mode.endswith("+tiled"):
        again += layers * mlp_forward_flops(one)
    elif mode.endswith("+tiled-layer"):
        again += layers * position_wise_forward_flops(one)
    elif mode.endswith("+tiled-heads"):  # the module docstring: q/k/v made once more, attention's forward again
        # k and v made once a group: with more groups than key/value heads, each head's again for
        # every group beside the first that uses it, in each of the three passes over the part
        kv_again = 3 * (inp.head_groups // inp.kv_heads - 1) * 4.0 * seq * inp.hidden * inp.kv_dim
        again += layers * (position_wise_forward_flops(one) + qkv_forward_flops(one) + attention_forward_flops(one)
                           + kv_again)
    if inp.loss_chunk:
        again += head
    rate, back_rate = inp.tflops * 1e12, (inp.backward_tflops or inp.tflops) * 1e12
    fwd, bwd = forward / rate, 2 * forward / back_rate + again / rate
    return {"forward_s": fwd, "backward_s": bwd, "step_s": fwd + bwd, "block_forward_s": block / rate,
            "head_forward_s": head / rate}


def long_context(inp) -> dict:
    """The section as a JSON-ready dict: per mode its longest sequence and, for the offload modes,
    the host memory, drive space and drive rate there (the module docstring)."""
    p, inflight, layers = _shape(inp)
    usable = _usable_bytes(inp)
    d, h = inp.dtype_bytes, inp.hidden
    per_token = inflight * layers * h * d  # the block inputs one token adds, on this GPU
    share = inp.host_gib * GIB if inp.host_tier else 0.0
    drive = min(inp.drive_gbps, inp.read_gbps) * inp.drives
    rows: dict[str, dict | None] = {}
    for mode in LONGCTX_MODES:
        seq, capped = _longest(inp, mode, usable)
        if seq is None:
            rows[mode] = None
            continue
        t = step_seconds(inp, mode, seq)
        ckpt = per_token * seq
        row = {"max_seq": seq, "capped": capped, "memory_gib": _memory(inp, mode, seq) / GIB,
               "checkpoint_bytes": ckpt, **t}
        if mode in OFFLOAD_MODES:
            nvme = max(0.0, ckpt - share)
            block_input = seq * h * d
            held = min(layers, int(share / inflight // block_input)) if block_input else layers
            today = (layers - held) * block_input  # one micro-batch's
            window = (layers - held) * t["block_forward_s"] + t["head_forward_s"]
            host_alone = min(seq, int(share // per_token) // _SEQ_STEP * _SEQ_STEP) if share else 0
            # Rates per micro-batch: each in flight (1F1B) writes its share during its own forward.
            row.update({
                "host_bytes": min(ckpt, share), "nvme_bytes": nvme,
                "drive_gbps_free": nvme / inflight / min(t["forward_s"], t["backward_s"]) / 1e9,
                "spilled_today_bytes": inflight * today,
                "drive_gbps_free_today": today / window / 1e9 if today else 0.0,
                "host_alone_seq": host_alone or None,
                "host_link_gbps": block_input / t["block_forward_s"] / 1e9,
            })
            row["drive_keeps_up"] = row["drive_gbps_free"] <= drive
        rows[mode] = row
    rec = (rows.get("recompute") or {}).get("max_seq")
    for row in rows.values():
        if row is not None:
            row["x_recompute"] = row["max_seq"] / rec if rec else None
    dp = max(1, inp.gpus // p)
    params = model_params(inp)
    opt_host = params * inp.trainable_fraction * inp.optimizer_host_bytes / (dp if inp.zero >= 1 else 1)
    return {
        "stages": p, "usable_gib": usable / GIB,
        "model_state_gib": model_state_bytes(inp, params, dp) / GIB if p == 1 else None,
        "params": params,
        "checkpoint_bytes_per_token": per_token,
        "host_share_gib": share / GIB, "node_host_gib": inp.node_host_gib, "gpus_per_node": inp.gpus_per_node,
        "drive_gbps": drive, "tile_tokens": inp.tile_tokens, "loss_chunk": inp.loss_chunk,
        "optimizer": inp.optimizer if inp.optimizer_bytes is None else f"{inp.optimizer_bytes:g} B/param",
        "optimizer_host_gib": opt_host / GIB,
        "modes": rows,
    }


def _g(n: float) -> str:
    return f"{n / GIB:.1f}"


def format_long_context(section: dict, inp: dict) -> list[str]:
    """Lines of the human-readable plan for :func:`long_context`'s section (``inp``: the plan's inputs)."""
    shape = (f"llama: {inp['heads']} heads, {inp['kv_heads']} KV heads, SwiGLU {inp['ffn_hidden']}"
             if inp["arch"] == "llama" else "gpt layer")
    states = "" if section["model_state_gib"] is None else (
        f"; model states {section['model_state_gib']:.1f} GiB ({section['params'] / 1e9:.2f}B params, "
        f"{section['optimizer']}, trained share {inp['trainable_fraction']:g})")
    share = f"host share {section['host_share_gib']:g} GiB per GPU"
    if section["node_host_gib"] is not None:
        share += f" ({section['node_host_gib']:g} GiB / {section['gpus_per_node']} GPUs per node)"
    lines = [
        f"long context: each mode's longest sequence per GPU (micro-batch 1, {section['stages']} stage(s), "
        f"{section['usable_gib']:.1f} GiB usable):",
        f"  {shape}; tiles of {section['tile_tokens']} tokens (+tiled: the MLP; +tiled-layer: every position-wise "
        "part; +tiled-heads: and attention a group of heads at a time); "
        + (f"loss chunks of {section['loss_chunk']} tokens" if section["loss_chunk"] else "the whole logits")
        + states,
        f"  block inputs {section['checkpoint_bytes_per_token'] / 1024:g} KiB a token; {share}; drives "
        f"{section['drive_gbps']:g} GB/s per GPU",
        f"  {'mode':<29} {'longest':>8} {'x rec.':>6} {'host only':>9} {'host GiB':>9} {'share':>7} "
        f"{'NVMe GiB':>9} {'GB/s free':>9} {'step s':>9}",
    ]
    notes = []
    for mode, row in section["modes"].items():
        if row is None:
            lines.append(f"  {mode:<29} does not fit (not even {_SEQ_STEP} tokens)")
            continue
        seq = f"{row['max_seq']}{'+' if row['capped'] else ''}"
        x = "-" if row["x_recompute"] is None else f"{row['x_recompute']:.2f}"
        if mode in OFFLOAD_MODES:
            alone = row["host_alone_seq"] or "-"
            cols = (f"{alone:>9} {_g(row['checkpoint_bytes']):>9} {section['host_share_gib']:>7g} "
                    f"{_g(row['nvme_bytes']):>9} {row['drive_gbps_free']:>9.2f}")
            if row["nvme_bytes"]:
                notes.append(
                    f"  {mode}: {_g(row['nvme_bytes'])} GiB to the drives at {row['max_seq']} tokens, free at "
                    f"{row['drive_gbps_free']:.2f} GB/s (over forward {row['forward_s']:.1f}s, backward "
                    f"{row['backward_s']:.1f}s){'' if row['drive_keeps_up'] else ': more than the drives give'}; "
                    f"as the offloader spills today (the last {_g(row['spilled_today_bytes'])} GiB of block inputs "
                    f"straight to the drives before forward ends): {row['drive_gbps_free_today']:.2f} GB/s")
        else:
            cols = f"{'-':>9} {'-':>9} {'-':>7} {'-':>9} {'-':>9}"
        lines.append(f"  {mode:<29} {seq:>8} {x:>6} {cols} {row['step_s']:>9.1f}")
    lines += notes
    off = section["modes"].get("recompute+offload+tiled") or section["modes"].get("recompute+offload")
    if off:
        lines.append(f"  host copies: a block input per block's forward, {off['host_link_gbps']:.2f} GB/s at "
                     f"{off['max_seq']} tokens (given {inp['host_gbps']:g})")
    if section["optimizer_host_gib"]:
        lines.append(f"  the offloaded optimizer holds {section['optimizer_host_gib']:.1f} GiB of host memory per GPU "
                     "(fp32 master and moments), beside the tier's share")
    return lines
