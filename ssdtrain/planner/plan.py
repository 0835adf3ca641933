"""``ssdtrain plan``: size micro-batches, pipeline stages and drive bandwidth for a real run.

Analytic and pure Python (no torch import), so it answers in milliseconds::

    ssdtrain plan --layers 80 --hidden 8192 --heads 64 --seq 8192 --vocab 128256 \\
        --gpus 64 --gpu-mem-gib 80 --global-batch 1024
    ssdtrain plan --model llama-3.1-8b --seq 131072 --gpus 1 --gpu-mem-gib 80 --global-batch 1 \\
        --trainable-fraction 0.01 --loss-chunk 4096 --host-gib 2048

The model behind the numbers, stated once (each is also in the JSON under ``assumptions``):

* **Activations** per transformer layer, micro-batch ``b``, no tensor parallelism: Korthikanti et
  al., "Reducing Activation Recomputation in Large Transformer Models" (2022), eq. 1:
  ``sbh(34 + 5as/h)`` bytes for 16-bit training with naive attention and dropout. It counts
  16 saved tensor elements of size sbh (2 LayerNorm inputs, QKV input, Q, K, V, projection input,
  MLP input, GELU input 4sbh, second MLP input 4sbh) at 2 bytes, two 1-byte dropout masks, and the
  s² terms: softmax output (2as²), its dropout mask (as²) and the dropped copy (2as²). We
  generalise the constants to a dtype of ``d`` bytes and dropout on/off:
  ``sbh(16d + 2·dropout) + as²b(d + dropout·(1 + d))`` for naive attention, and the same without
  the s² term for flash attention (its saved output is the projection's input, its log-sum-exp is
  O(as) and ignored). With d=2 and dropout this is exactly the published formula.
* **Llama blocks** (``--arch llama``, or ``--model llama-3.1-8b``): RMSNorm, RoPE, grouped-query
  attention (``--kv-heads``; k and v ``kv = hidden x kv_heads / heads`` wide), a SwiGLU MLP of
  ``--ffn-hidden``, no dropout, an untied head. A block saves, per token, ``d(6h + 2kv + 4f) + 4a + 8``
  bytes (``plan_layer.llama_activation_bytes_per_layer``: its input and normed copy, q, k, v, the
  attention output, the MLP's input and normed copy, gate, ``silu(gate)``, up, their product; RMSNorm's
  fp32 rstd and flash attention's log-sum-exp): 168,072 bytes for Llama-3.1-8B in bf16 (h 4096,
  kv 1024, f 14336, a 32); without flash attention ``d·a·s`` more. Its parameters: ``2h² + 2h·kv +
  3hf + 2h``. Forward FLOPs: ``2sh(2h + 2kv + 3f)`` and causal attention ``2s²h`` (half the square).
* **Model states**: 16 bytes per parameter (bf16/fp16 weight and gradient, fp32 master weight and
  two Adam moments; fp32 training also comes to 16), no ZeRO sharding, divided over pipeline
  stages by layers (the first stage also holds the embeddings, the last the tied head's logits).
  ``--trainable-fraction``: only that share has gradients and optimizer state; ``--optimizer``:
  ``adamw`` 12 bytes of state per trained parameter (16 in all), ``adamw8bit`` 6 (fp32 master, two
  1-byte moments: 10 in all), ``offloaded`` none on the GPU (4 in all; 12 in host memory);
  ``--zero`` shards them over the data-parallel ranks.
* **Memory per GPU**: the first pipeline stage under 1F1B holds the activations of ``min(m, p)``
  micro-batches for its layers; the last stage holds one micro-batch plus the fp32 log-softmax
  of the logits (4·sbV). We report the larger. ``recompute`` keeps only each layer's input
  (d·sbh) plus one layer's full activations while it is recomputed; ``offload`` keeps
  ``OFFLOAD_RESIDENT_LAYERS`` layers of one micro-batch resident (the one being computed and the
  one being written or read). 10% of GPU memory is reserved for the framework, workspace and
  fragmentation.
* **Time**: forward FLOPs per layer per sequence 24sh² + 4s²h, plus 2shV for the LM head;
  training = 3× forward (recompute: 4× for the layers). ``--tflops`` is the throughput a GPU
  actually achieves; ``--tflops-at`` gives it per micro-batch size where measured (small
  micro-batches run below the best rate). A 1F1B step takes ``(m + p − 1)`` slots of one
  micro-batch's forward and backward on the slowest stage; bubble fraction ``(p − 1)/(m + p − 1)``.
  With ``--virtual-stages v`` the planner also weighs Megatron-Core's interleaved schedule: ``m +
  (p − 1)/v`` slots, bubble ``(p − 1)/(vm + p − 1)``, and more in flight on each stage
  (``plan_model.inflight_layers``). ``--allreduce-gbps`` adds the data-parallel gradient
  all-reduce (a ring: ``2(dp − 1)/dp`` of a stage's gradient bytes); pipeline send/receive and the
  optimizer's step are not modelled (ties go to fewer stages, fewer chunks, then larger
  micro-batches).
* **Drive** (offload): ``--drives`` drives per GPU of ``--drive-gbps`` each. In a 1F1B slot a
  stage writes one micro-batch's activations and reads another's back. The required write
  bandwidth is those bytes over the slot time; reads are assumed at least as fast as writes and
  to proceed concurrently. When the drive is slower, the slot stretches to the write time and
  the difference is reported as stall (a strict memory bound: ``when_full="wait"``).
  Drive-writes per day = bytes written per GPU per day / the drive capacity per GPU.
* **Recompute's working set** (``plan_layer.block_working_bytes``): the block backward recomputes.
  ``gpt``: one layer's activations (above). ``llama``: the larger of its MLP's moment (the block's
  saves, the residual's and the MLP input's gradients ``2dh``, the SwiGLU's gradients ``3df`` a
  token) and its attention's (the attention half's saves, the gradients of the residual, attention
  output, q, k, v ``d(3h + 2kv)``, FlashAttention-2's fp32 dq accumulator ``4h``). The head's saves
  and one loss chunk's logits come on top (``gpt``), or are freed before the blocks' backward and
  so count as their own moment (``llama``).
* **Long context** (``long_context`` in the JSON; :mod:`ssdtrain.planner.plan_longctx`): each
  mode's longest sequence per GPU: baseline, recompute, ``recompute+tiled`` (the MLP a tile of
  ``--tile-tokens`` positions at a time: its SwiGLU tensors for one tile only), ``recompute+tiled-layer``
  (every position-wise part of the block so: of the whole sequence only the block's input, q, k, v,
  the attention output and their gradients, ``plan_layer.layer_tiled_moments``), ``recompute+offload``,
  ``recompute+tiled-heads`` (that, and attention a group of query heads at a time: of the whole
  sequence the block's input, attention's output and three gradients, ``plan_layer.layer_heads_moments``),
  ``recompute+offload+tiled``, ``+tiled-layer`` and ``+tiled-heads`` (every block input off the GPU but 2: the recomputed block's and
  one in flight; ``L x s x h x d`` bytes, 256 KiB a token for Llama-3.1-8B, to the host share
  ``--host-gib``, or ``--node-host-gib`` over ``--gpus-per-node``, and the rest to the drives), with
  the host memory and drive space that needs and the drive rate at which the spill is free:
  ``spilled / min(T_forward, T_backward)`` (``T`` from the FLOPs at ``--tflops``; backward twice
  forward plus what it recomputes).
* **Drive-limited** (``drive_limited`` in the JSON; :mod:`ssdtrain.planner.plan_drive`): what the
  offloader's default policy (never wait on the drive) offloads at no cost, with and without
  checkpointing, save by save: about ``min(B_write T_forward, B_read T_backward)`` per
  micro-batch, less what the order of the saves forbids; the micro-batch and bubble the freed
  memory buys, and the drives full offload needs. ``--tflops`` and ``--backward-tflops`` set
  the compute rate, so a measured one predicts a given machine (``benchmarks/plan_vs_bench.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from ssdtrain._units import fmt_bytes
from ssdtrain.planner.plan_drive import add_arguments, drive_limited, format_drive, input_fields
from ssdtrain.planner.plan_longctx import format_long_context, long_context
from ssdtrain.planner.plan_longest import format_longest, longest
# Re-exported: the model's names are also this module's (tests and callers use ``plan.Inputs``...).
from ssdtrain.planner.plan_inputs import BYTES_PER_PARAM, DTYPE_BYTES, Inputs  # noqa: F401
from ssdtrain.planner.plan_layer import activation_bytes_per_layer, head_activation_bytes  # noqa: F401
from ssdtrain.planner.plan_model import (MODES, OFFLOAD_RESIDENT_LAYERS, RESERVE_FRACTION, Config,  # noqa: F401
                                         _stage_counts, _stage_memory, best_config, evaluate,
                                         max_micro_batch)

__all__ = ["MODELS", "MODES", "Config", "Inputs", "activation_bytes_per_layer", "best_config", "evaluate",
           "format_plan", "head_activation_bytes", "main", "max_micro_batch", "plan"]

MODELS = {
    # --model presets (the flags they stand for; a flag given as well wins): the configs on the Hub.
    "llama-3.1-8b": dict(arch="llama", layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, vocab=128256),
    "llama-3.1-70b": dict(arch="llama", layers=80, hidden=8192, heads=64, kv_heads=8, ffn_hidden=28672, vocab=128256),
}


def plan(inp: Inputs) -> dict:
    """The whole plan as a JSON-ready dict (the structure ``--json`` writes)."""
    best = {mode: best_config(inp, mode) for mode in MODES}
    max_mb = {}
    for mode in MODES:
        p = inp.stages or (best[mode].stages if best[mode] else _stage_counts(inp)[-1])
        max_mb[mode] = max_micro_batch(inp, mode, p)

    # Drive figures for offloading everything at the best offload configuration: the bandwidth
    # at which offloading is free, and what it does to the drive's endurance.
    off = best["offload"]
    full = evaluate(inp, "offload", off.stages, off.micro_batch, offload_fraction=1.0) if off else None
    required = full.required_write_gbps if full else None
    dwpd = None
    if full and full.step_time_s > 0:
        per_day = full.written_bytes_per_step / full.step_time_s * 86400
        dwpd = per_day / (inp.drive_tb * 1e12)
    return {
        "inputs": asdict(inp),
        "activation_bytes_per_layer": inp.act_layer(1),
        "activation_formula": _formula(inp),
        "max_micro_batch": max_mb,
        "best": {mode: (asdict(c) if c else None) for mode, c in best.items()},
        "required_write_gbps": required,
        "drive_writes_per_day": dwpd,
        "full_offload": asdict(full) if full else None,
        "drive_limited": drive_limited(inp),
        "longest_seq": longest(inp),
        "long_context": long_context(inp),
        "assumptions": {
            "bytes_per_param": BYTES_PER_PARAM,
            "optimizer_bytes_per_trained_param": {"gpu": inp.optimizer_gpu_bytes, "host": inp.optimizer_host_bytes},
            "reserved_fraction": RESERVE_FRACTION,
            "offload_resident_layers": OFFLOAD_RESIDENT_LAYERS,
            "schedule": "1F1B, bubble (p-1)/(m+p-1); interleaved (--virtual-stages v) (p-1)/(vm+p-1); "
                        "no tensor parallelism",
            "drive_gbps_is": "sustained write bandwidth per drive, --drives per GPU; reads >= writes, concurrent",
        },
    }


def _formula(inp: Inputs) -> str:
    attention = f"{'flash' if inp.flash else 'naive'} attention"
    if inp.arch == "llama":
        d, h, kv, f = inp.dtype_bytes, inp.hidden, inp.kv_dim, inp.ffn_hidden
        return (f"s({d}(6h + 2kv + 4f) + 4a + 8) = s x {d * (6 * h + 2 * kv + 4 * f) + 4 * inp.heads + 8}"
                + ("" if inp.flash else f" + {d}as²") + f" bytes, {inp.dtype}, {attention}, Llama block "
                f"(kv {kv}, f {f}), no dropout")
    return (f"sbh({16 * inp.dtype_bytes + 2 * inp.dropout}"
            + ("" if inp.flash else f" + {inp.dtype_bytes + (1 + inp.dtype_bytes) * inp.dropout}as/h")
            + f") bytes, {inp.dtype}, {attention}, dropout {'on' if inp.dropout else 'off'}")


def format_plan(result: dict) -> str:
    """Human-readable report of :func:`plan`'s result."""
    inp = result["inputs"]
    arch = "" if inp.get("arch", "gpt") == "gpt" else (
        f" (llama: {inp['kv_heads']} KV heads, SwiGLU {inp['ffn_hidden']}, RMSNorm, RoPE)")
    lines = [
        f"model: {inp['layers']} layers, hidden {inp['hidden']}, {inp['heads']} heads, "
        f"seq {inp['seq']}, vocab {inp['vocab']}, {inp['dtype']}{arch}",
        f"cluster: {inp['gpus']} GPUs x {inp['gpu_mem_gib']:g} GiB, {inp['tflops']:g} TFLOPS achieved, "
        f"{inp['drives']} x {inp['drive_gbps']:g} GB/s drive(s) per GPU; global batch {inp['global_batch']}",
        f"activations per layer per sequence: {fmt_bytes(result['activation_bytes_per_layer'])}"
        f"  [{result['activation_formula']}]",
        "",
        f"{'mode':<10} {'max mb':>6} {'stages':>6} {'dp':>4} {'mb':>4} {'#mb':>5} {'bubble':>7} "
        f"{'mem/GPU':>10} {'step':>9} {'stall':>8}",
    ]
    for mode in MODES:
        cfg = result["best"][mode]
        mmb = result["max_micro_batch"][mode]
        if cfg is None:
            lines.append(f"{mode:<10} {mmb:>6}  does not fit at any configuration")
            continue
        v = cfg.get("virtual_stages", 1)
        stages = f"{cfg['stages']}x{v}" if v > 1 else str(cfg["stages"])
        lines.append(
            f"{mode:<10} {mmb:>6} {stages:>6} {cfg['data_parallel']:>4} {cfg['micro_batch']:>4} "
            f"{cfg['num_microbatches']:>5} {cfg['bubble_fraction']:>6.1%} "
            f"{cfg['memory_gib']:>6.1f} GiB {cfg['step_time_s']:>8.3f}s {cfg['stall_s']:>7.3f}s"
        )
    lines.append("")
    drive = [""] + format_drive(result["drive_limited"]) + [""] + format_longest(result["longest_seq"])
    if "long_context" in result:
        drive += [""] + format_long_context(result["long_context"], inp)
    if result["required_write_gbps"] is None:
        lines.append("offload: no fitting configuration, no drive figures")
        return "\n".join(lines + drive)
    off, full = result["best"]["offload"], result["full_offload"]
    keeps_up = full["stall_s"] == 0
    lines.append(
        f"offloading all activations at {full['stages']} stage(s), micro-batch {full['micro_batch']} "
        f"needs {result['required_write_gbps']:.2f} GB/s of drive writes per GPU "
        f"(given {inp['drive_gbps'] * inp['drives']:g}): "
        + ("the drive keeps up." if keeps_up else
           f"the drive cannot keep up, {full['stall_s']:.3f}s stall per step "
           f"({full['step_time_s']:.3f}s instead of {full['step_time_s'] - full['stall_s']:.3f}s).")
    )
    lines.append(
        f"  that is {fmt_bytes(full['written_bytes_per_step'])} written per GPU per step, "
        f"{result['drive_writes_per_day']:.2f} drive-writes per day on {inp['drive_tb']:g} TB per GPU"
    )
    lines.append(
        f"best offload plan writes {off['offload_fraction']:.0%} of the activations "
        f"({off['required_write_gbps']:.2f} GB/s)"
        + (", i.e. nothing: it fits without offloading." if off["offload_fraction"] == 0 else ".")
    )
    return "\n".join(lines + drive)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="ssdtrain plan",
        description="Analytic sizing of micro-batches, pipeline stages and drive bandwidth "
        "for baseline, full recompute and ssdtrain offloading.",
    )
    ap.add_argument("--model", choices=sorted(MODELS),
                    help="a known model's shape: --arch, --layers, --hidden, --heads, --kv-heads, --ffn-hidden, "
                    "--vocab (each may still be given)")
    ap.add_argument("--arch", choices=("gpt", "llama"), default=None,
                    help="gpt (default): Korthikanti's layer, LayerNorm, GELU MLP of 4 x hidden, dropout; llama: "
                    "RMSNorm, RoPE, grouped-query attention, SwiGLU MLP, no dropout, untied head")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--heads", type=int)
    ap.add_argument("--kv-heads", type=int, default=None, help="key/value heads (llama; default --heads)")
    ap.add_argument("--ffn-hidden", type=int, default=None,
                    help="the MLP's inner width (llama; default 8 x hidden / 3 rounded up to 256)")
    ap.add_argument("--seq", type=int, required=True)
    ap.add_argument("--vocab", type=int)
    ap.add_argument("--tile-tokens", type=int, default=None,
                    help="positions per tile in the +tiled (the MLP) and +tiled-layer (every position-wise part) "
                    "long-context modes (ssdtrain.longctx; default: "
                    "the hidden size, as long_context's)")
    ap.add_argument("--head-groups", type=int, default=None,
                    help="the +tiled-heads long-context modes (llama): groups of query heads attention runs one at "
                    "a time (default: one per key/value head; up to --heads, one head a group)")
    ap.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bf16")
    ap.add_argument("--no-flash", action="store_true", help="naive attention (saves the s x s scores)")
    ap.add_argument("--no-dropout", action="store_true", help="no dropout masks saved")
    ap.add_argument("--gpus", type=int, required=True)
    ap.add_argument("--gpu-mem-gib", type=float, required=True)
    ap.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    ap.add_argument("--stages", type=int, default=None, help="pipeline stages (default: best)")
    ap.add_argument("--tflops", type=float, default=400.0,
                    help="achieved TFLOPS per GPU (default 400)")
    ap.add_argument("--tflops-at", default=None, metavar="B:TFLOPS,...",
                    help="achieved TFLOPS measured per micro-batch size, e.g. 1:310,2:380,4:400 (sizes between "
                    "interpolated, outside the nearest; default: --tflops at every size)")
    ap.add_argument("--allreduce-gbps", type=float, default=0.0, metavar="GBPS",
                    help="bus bandwidth of the data-parallel gradient all-reduce, GB/s (nccl-tests' busbw); "
                    "default 0: not modelled")
    ap.add_argument("--untied-head", action="store_true",
                    help="gpt: the head is a weight of its own, not the embedding's (Megatron-Core's "
                    "share_embeddings_and_output_weights=False)")
    ap.add_argument("--virtual-stages", type=int, default=1, metavar="V",
                    help="also weigh Megatron-Core's interleaved 1F1B with V model chunks a stage (default 1: "
                    "plain 1F1B; DeepSpeed's PipelineEngine has no interleaving)")
    ap.add_argument("--drive-gbps", type=float, default=3.0,
                    help="sustained write bandwidth of one drive, GB/s (default 3)")
    ap.add_argument("--drive-tb", type=float, default=3.84,
                    help="drive capacity per GPU in TB, for drive-writes per day (default 3.84)")
    ap.add_argument("--trainable-fraction", type=float, default=1.0,
                    help="share of the parameters trained (PEFT, LoRA: about 0.01); frozen ones have no gradient "
                    "or optimizer state (default 1)")
    opt = ap.add_mutually_exclusive_group()
    opt.add_argument("--optimizer", choices=("adamw", "adamw8bit", "offloaded"), default="adamw",
                     help="optimizer state per trained parameter beside its 16-bit weight and gradient: adamw "
                     "(default) an fp32 master and two fp32 moments, 12 bytes (16 in all); adamw8bit "
                     "(bitsandbytes) the master and two 1-byte moments, 6 (10 in all); offloaded (the step on the "
                     "CPU) none on the GPU (4 in all), 12 in host memory")
    opt.add_argument("--optimizer-bytes", type=float, default=None, metavar="B",
                     help="optimizer state per trained parameter, bytes (instead of --optimizer; AdamW in bf16 "
                     "with no master copy: 4)")
    ap.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0,
                    help="model states sharded over the data-parallel ranks: 1 optimizer states, 2 and gradients, "
                    "3 and weights (FSDP full sharding, ZeRO-3); default 0")
    ap.add_argument("--loss-chunk", type=int, default=0, metavar="TOKENS",
                    help="a chunked loss (fused linear cross-entropy) holding one chunk's logits; default 0: the "
                    "whole sequence's logits")
    ap.add_argument("--json", metavar="PATH", help="also write the plan as JSON")
    add_arguments(ap)
    return ap


def _tflops_at(text: str | None) -> tuple:
    """``--tflops-at 1:310,2:380``: ``((1, 310.0), (2, 380.0))``."""
    if not text:
        return ()
    pairs = []
    for item in text.split(","):
        b, sep, rate = item.partition(":")
        bad = ValueError(f"--tflops-at: {item!r} is not MICRO_BATCH:TFLOPS (e.g. 2:380)")
        if not sep:
            raise bad
        try:
            pairs.append((int(b), float(rate)))
        except ValueError:
            raise bad from None
    return tuple(pairs)


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    shape = dict(MODELS[args.model]) if args.model else {"arch": "gpt"}
    for name in ("arch", "layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab"):
        if getattr(args, name) is not None:
            shape[name] = getattr(args, name)
    missing = [f"--{n}" for n in ("layers", "hidden", "heads", "vocab") if n not in shape]
    if missing:
        ap.error(f"the following arguments are required (or --model): {', '.join(missing)}")
    try:
        inp = Inputs(
            layers=shape["layers"], hidden=shape["hidden"], heads=shape["heads"], seq=args.seq,
            vocab=shape["vocab"], arch=shape["arch"], kv_heads=shape.get("kv_heads"),
            ffn_hidden=shape.get("ffn_hidden"), tile_tokens=args.tile_tokens, optimizer=args.optimizer,
            head_groups=args.head_groups,
            gpus=args.gpus, gpu_mem_gib=args.gpu_mem_gib,
            global_batch=args.global_batch, dtype=args.dtype, flash=not args.no_flash,
            dropout=not args.no_dropout, stages=args.stages, tflops=args.tflops,
            drive_gbps=args.drive_gbps, drive_tb=args.drive_tb, trainable_fraction=args.trainable_fraction,
            optimizer_bytes=args.optimizer_bytes, zero=args.zero, loss_chunk=args.loss_chunk,
            virtual_stages=args.virtual_stages, tflops_at=_tflops_at(args.tflops_at),
            allreduce_gbps=args.allreduce_gbps, tied_head=not args.untied_head, **input_fields(args),
        )
    except ValueError as exc:
        print(f"ssdtrain plan: {exc}", file=sys.stderr)
        return 2
    result = plan(inp)
    print(format_plan(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    return 0
