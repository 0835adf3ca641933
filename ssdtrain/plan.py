"""``ssdtrain plan``: size micro-batches, pipeline stages and drive bandwidth for a real run.

Analytic and pure Python (no torch import), so it answers in milliseconds::

    ssdtrain plan --layers 80 --hidden 8192 --heads 64 --seq 8192 --vocab 128256 \\
        --gpus 64 --gpu-mem-gib 80 --global-batch 1024

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
* **Model states**: 16 bytes per parameter (bf16/fp16 weight and gradient, fp32 master weight and
  two Adam moments; fp32 training also comes to 16), no ZeRO sharding, divided over pipeline
  stages by layers (the first stage also holds the embeddings, the last the tied head's logits).
* **Memory per GPU**: the first pipeline stage under 1F1B holds the activations of ``min(m, p)``
  micro-batches for its layers; the last stage holds one micro-batch plus the fp32 log-softmax
  of the logits (4·sbV). We report the larger. ``recompute`` keeps only each layer's input
  (d·sbh) plus one layer's full activations while it is recomputed; ``offload`` keeps
  ``OFFLOAD_RESIDENT_LAYERS`` layers of one micro-batch resident (the one being computed and the
  one being written or read). 10% of GPU memory is reserved for the framework, workspace and
  fragmentation.
* **Time**: forward FLOPs per layer per sequence 24sh² + 4s²h, plus 2shV for the LM head;
  training = 3× forward (recompute: 4× for the layers). ``--tflops`` is the throughput a GPU
  actually achieves. A 1F1B step takes ``(m + p − 1)`` slots of one micro-batch's forward and
  backward on one stage; bubble fraction ``(p − 1)/(m + p − 1)``. Data-parallel gradient
  all-reduce, pipeline send/receive and the lower efficiency of small micro-batches are not
  modelled, so among fitting configurations the fastest is the one with the smallest bubble
  (ties go to fewer stages, then larger micro-batches).
* **Drive** (offload): ``--drives`` drives per GPU of ``--drive-gbps`` each. In a 1F1B slot a
  stage writes one micro-batch's activations and reads another's back. The required write
  bandwidth is those bytes over the slot time; reads are assumed at least as fast as writes and
  to proceed concurrently. When the drive is slower, the slot stretches to the write time and
  the difference is reported as stall (a strict memory bound: ``when_full="wait"``).
  Drive-writes per day = bytes written per GPU per day / the drive capacity per GPU.
* **Drive-limited** (``drive_limited`` in the JSON; :mod:`ssdtrain.plan_drive`): what the
  offloader's default policy (never wait on the drive) offloads at no cost, with and without
  checkpointing, save by save: about ``min(B_write T_forward, B_read T_backward)`` per
  micro-batch, less what the order of the saves forbids; the micro-batch and bubble the freed
  memory buys, and the drives full offload needs. ``--tflops`` and ``--backward-tflops`` set
  the compute rate, so a measured one predicts a given machine (``benchmarks/plan_vs_bench.py``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass

__all__ = ["MODES", "Config", "Inputs", "activation_bytes_per_layer", "best_config", "evaluate", "format_plan",
           "head_activation_bytes", "main", "max_micro_batch", "plan"]

MODES = ("baseline", "recompute", "offload")
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
BYTES_PER_PARAM = 16
RESERVE_FRACTION = 0.10
OFFLOAD_RESIDENT_LAYERS = 2
GIB = 1 << 30


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
    ``sbh(34 + 5as/h)``; ``flash=True`` drops the s² term. See the module docstring for the
    generalisation to other dtypes and to no dropout.
    """
    s, b, h, a, d = seq, micro_batch, hidden, heads, dtype_bytes
    sbh = s * b * h
    total = sbh * (16 * d + (2 if dropout else 0))
    if not flash:
        total += a * s * s * b * (d + ((1 + d) if dropout else 0))
    return total


def head_activation_bytes(seq: int, hidden: int, vocab: int, micro_batch: int = 1, *, dtype_bytes: int = 2) -> int:
    """Bytes saved around the LM head: final LayerNorm and head inputs, fp32 log-softmax (4sbV)."""
    sb = seq * micro_batch
    return 4 * sb * vocab + 2 * dtype_bytes * sb * hidden


def _divisors(n: int) -> list[int]:
    small = [i for i in range(1, math.isqrt(n) + 1) if n % i == 0]
    return sorted(set(small + [n // i for i in small]))


@dataclass(frozen=True)
class Inputs:
    """What ``ssdtrain plan`` is asked about."""

    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    gpus: int
    gpu_mem_gib: float
    global_batch: int
    dtype: str = "bf16"
    flash: bool = True
    dropout: bool = True
    stages: int | None = None
    tflops: float = 400.0
    drive_gbps: float = 3.0
    drive_tb: float = 3.84
    drives: int = 1
    drive_read_gbps: float | None = None
    backward_tflops: float | None = None
    min_bytes: int = 1 << 20
    handoff_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "seq", "vocab", "gpus", "global_batch", "drives"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if not isinstance(self.min_bytes, int) or self.min_bytes < 0:
            raise ValueError(f"--min-bytes must be an integer >= 0, got {self.min_bytes!r}")
        if not isinstance(self.handoff_bytes, int) or self.handoff_bytes < 1:
            raise ValueError(f"--handoff-mib must come to at least 1 byte, got {self.handoff_bytes!r} bytes")
        for name in ("gpu_mem_gib", "tflops", "drive_gbps", "drive_tb", "drive_read_gbps", "backward_tflops"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)!r}")
        if self.hidden % self.heads:
            raise ValueError(f"--hidden ({self.hidden}) must be divisible by --heads ({self.heads})")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"--dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")
        if self.stages is not None:
            if not isinstance(self.stages, int) or self.stages < 1 or self.stages > self.layers:
                raise ValueError(f"--stages must be in 1..layers ({self.layers}), got {self.stages!r}")
            if self.gpus % self.stages:
                raise ValueError(f"--stages ({self.stages}) must divide --gpus ({self.gpus})")

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def read_gbps(self) -> float:
        return self.drive_read_gbps or self.drive_gbps

    def act_layer(self, micro_batch: int) -> int:
        return activation_bytes_per_layer(
            self.seq, self.hidden, self.heads, micro_batch,
            dtype_bytes=self.dtype_bytes, flash=self.flash, dropout=self.dropout,
        )


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


def _layer_params(h: int) -> int:
    # QKV 3h² + 3h, projection h² + h, MLP 8h² + 5h, two LayerNorms 4h.
    return 12 * h * h + 13 * h


def _stage_memory(inp: Inputs, mode: str, p: int, b: int, m: int, offload_fraction: float = 1.0) -> float:
    """Peak bytes on the busier of the first and last pipeline stage."""
    s, h, v, d = inp.seq, inp.hidden, inp.vocab, inp.dtype_bytes
    layers = math.ceil(inp.layers / p)
    inflight = min(m, p)
    act = inp.act_layer(b)
    if mode == "baseline":
        first_act = layers * inflight * act
        last_act = layers * act
    elif mode == "recompute":
        first_act = layers * inflight * d * s * b * h + act
        last_act = layers * d * s * b * h + act
    elif mode == "offload":
        # A fraction f of the activations goes to the drive; the rest stays like baseline's.
        window = min(layers, OFFLOAD_RESIDENT_LAYERS) * act if offload_fraction > 0 else 0
        first_act = (1 - offload_fraction) * layers * inflight * act + window
        last_act = (1 - offload_fraction) * layers * act + window
    else:
        raise ValueError(f"unknown mode {mode!r}; choose one of {MODES}")
    embed = (v + s) * h
    first = (layers * _layer_params(h) + embed) * BYTES_PER_PARAM + first_act
    head_act = head_activation_bytes(s, h, v, b, dtype_bytes=d)
    last = (layers * _layer_params(h) + (v * h if p > 1 else 0)) * BYTES_PER_PARAM + last_act + head_act
    return first if p == 1 else max(first, last)


def _usable_bytes(inp: Inputs) -> float:
    return inp.gpu_mem_gib * GIB * (1 - RESERVE_FRACTION)


def _offload_fraction(inp: Inputs, p: int, b: int, m: int) -> float:
    """Smallest share of the activations that must go to the drive for the stage to fit.

    0 if everything fits in memory (then nothing is written), 1 if even full offload does not
    fit (the caller rejects the point). Memory is linear in the fraction on each stage.
    """
    usable = _usable_bytes(inp)
    if _stage_memory(inp, "offload", p, b, m, 0.0) <= usable:
        return 0.0
    full = _stage_memory(inp, "offload", p, b, m, 1.0)
    if full > usable:
        return 1.0
    lo, hi = 0.0, 1.0  # memory(lo) > usable >= memory(hi)
    for _ in range(40):
        mid = (lo + hi) / 2
        if _stage_memory(inp, "offload", p, b, m, mid) <= usable:
            hi = mid
        else:
            lo = mid
    return hi


def evaluate(
    inp: Inputs, mode: str, p: int, b: int, *, offload_fraction: float | None = None
) -> Config | None:
    """The point (mode, p stages, micro-batch b), or ``None`` if it is not a valid split.

    For ``offload`` the point writes the smallest share of activations that makes it fit,
    unless ``offload_fraction`` forces one; memory is not checked here (see
    :func:`best_config`).
    """
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of {MODES}")
    if inp.gpus % p or p > inp.layers:
        return None
    dp = inp.gpus // p
    if inp.global_batch % (dp * b):
        return None
    m = inp.global_batch // (dp * b)
    s, h, v = inp.seq, inp.hidden, inp.vocab
    layers = math.ceil(inp.layers / p)
    fwd_layer = 24 * s * h * h + 4 * s * s * h
    layer_factor = 4 if mode == "recompute" else 3
    # The slowest stage: its layers plus the LM head (the last stage's share).
    slot = b * (layers * fwd_layer * layer_factor + 3 * 2 * s * h * v) / (inp.tflops * 1e12)
    fraction = 0.0
    written = 0
    required = 0.0
    stall = 0.0
    if mode == "offload":
        fraction = _offload_fraction(inp, p, b, m) if offload_fraction is None else offload_fraction
        per_mb = fraction * layers * inp.act_layer(b)
        written = int(per_mb * m)
        required = per_mb / slot / 1e9
        stall = m * max(0.0, per_mb / (inp.drive_gbps * inp.drives * 1e9) - slot)
    return Config(
        mode=mode,
        stages=p,
        data_parallel=dp,
        micro_batch=b,
        num_microbatches=m,
        bubble_fraction=(p - 1) / (m + p - 1),
        memory_gib=_stage_memory(inp, mode, p, b, m, fraction) / GIB,
        step_time_s=(m + p - 1) * slot + stall,
        stall_s=stall,
        offload_fraction=fraction,
        written_bytes_per_step=written,
        required_write_gbps=required,
    )


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
    """Fastest fitting configuration for the global batch (ties: fewer stages, larger micro-batch)."""
    usable_gib = _usable_bytes(inp) / GIB
    best = None
    for p in _stage_counts(inp):
        dp = inp.gpus // p
        if inp.global_batch % dp:
            continue
        per_replica = inp.global_batch // dp
        for b in _divisors(per_replica):
            cfg = evaluate(inp, mode, p, b)
            if cfg is None or cfg.memory_gib > usable_gib:
                continue
            key = (float(f"{cfg.step_time_s:.9g}"), cfg.stages, -cfg.micro_batch)
            if best is None or key < best[0]:
                best = (key, cfg)
    return None if best is None else best[1]


def plan(inp: Inputs) -> dict:
    """The whole plan as a JSON-ready dict (the structure ``--json`` writes)."""
    best = {mode: best_config(inp, mode) for mode in MODES}
    max_mb = {}
    for mode in MODES:
        p = inp.stages or (best[mode].stages if best[mode] else _stage_counts(inp)[-1])
        max_mb[mode] = max_micro_batch(inp, mode, p)
    from ssdtrain.plan_drive import drive_limited

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
        "activation_formula": (
            f"sbh({16 * inp.dtype_bytes + 2 * inp.dropout}"
            + ("" if inp.flash else f" + {inp.dtype_bytes + (1 + inp.dtype_bytes) * inp.dropout}as/h")
            + f") bytes, {inp.dtype}, {'flash' if inp.flash else 'naive'} attention, "
            + f"dropout {'on' if inp.dropout else 'off'}"
        ),
        "max_micro_batch": max_mb,
        "best": {mode: (asdict(c) if c else None) for mode, c in best.items()},
        "required_write_gbps": required,
        "drive_writes_per_day": dwpd,
        "full_offload": asdict(full) if full else None,
        "drive_limited": drive_limited(inp),
        "assumptions": {
            "bytes_per_param": BYTES_PER_PARAM,
            "reserved_fraction": RESERVE_FRACTION,
            "offload_resident_layers": OFFLOAD_RESIDENT_LAYERS,
            "schedule": "1F1B, bubble (p-1)/(m+p-1); no tensor parallelism, no ZeRO",
            "drive_gbps_is": "sustained write bandwidth per drive, --drives per GPU; reads >= writes, concurrent",
        },
    }


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def format_plan(result: dict) -> str:
    """Human-readable report of :func:`plan`'s result."""
    inp = result["inputs"]
    lines = [
        f"model: {inp['layers']} layers, hidden {inp['hidden']}, {inp['heads']} heads, "
        f"seq {inp['seq']}, vocab {inp['vocab']}, {inp['dtype']}",
        f"cluster: {inp['gpus']} GPUs x {inp['gpu_mem_gib']:g} GiB, {inp['tflops']:g} TFLOPS achieved, "
        f"{inp['drives']} x {inp['drive_gbps']:g} GB/s drive(s) per GPU; global batch {inp['global_batch']}",
        f"activations per layer per sequence: {_fmt_bytes(result['activation_bytes_per_layer'])}"
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
        lines.append(
            f"{mode:<10} {mmb:>6} {cfg['stages']:>6} {cfg['data_parallel']:>4} {cfg['micro_batch']:>4} "
            f"{cfg['num_microbatches']:>5} {cfg['bubble_fraction']:>6.1%} "
            f"{cfg['memory_gib']:>6.1f} GiB {cfg['step_time_s']:>8.3f}s {cfg['stall_s']:>7.3f}s"
        )
    lines.append("")
    from ssdtrain.plan_drive import format_drive

    drive = [""] + format_drive(result["drive_limited"])
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
        f"  that is {_fmt_bytes(full['written_bytes_per_step'])} written per GPU per step, "
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
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--hidden", type=int, required=True)
    ap.add_argument("--heads", type=int, required=True)
    ap.add_argument("--seq", type=int, required=True)
    ap.add_argument("--vocab", type=int, required=True)
    ap.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bf16")
    ap.add_argument("--no-flash", action="store_true", help="naive attention (saves the s x s scores)")
    ap.add_argument("--no-dropout", action="store_true", help="no dropout masks saved")
    ap.add_argument("--gpus", type=int, required=True)
    ap.add_argument("--gpu-mem-gib", type=float, required=True)
    ap.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    ap.add_argument("--stages", type=int, default=None, help="pipeline stages (default: best)")
    ap.add_argument("--tflops", type=float, default=400.0,
                    help="achieved TFLOPS per GPU (default 400)")
    ap.add_argument("--drive-gbps", type=float, default=3.0,
                    help="sustained write bandwidth of one drive, GB/s (default 3)")
    ap.add_argument("--drive-tb", type=float, default=3.84,
                    help="drive capacity per GPU in TB, for drive-writes per day (default 3.84)")
    ap.add_argument("--json", metavar="PATH", help="also write the plan as JSON")
    from ssdtrain.plan_drive import add_arguments

    add_arguments(ap)
    return ap


def main(argv: list[str] | None = None) -> int:
    from ssdtrain.plan_drive import input_fields

    args = _parser().parse_args(argv)
    try:
        inp = Inputs(
            layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq,
            vocab=args.vocab, gpus=args.gpus, gpu_mem_gib=args.gpu_mem_gib,
            global_batch=args.global_batch, dtype=args.dtype, flash=not args.no_flash,
            dropout=not args.no_dropout, stages=args.stages, tflops=args.tflops,
            drive_gbps=args.drive_gbps, drive_tb=args.drive_tb, **input_fields(args),
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
