"""The memory and time model of ``ssdtrain plan`` (stated in ``plan.py``'s docstring): model states,
activations and the step per pipeline configuration. Pure Python, no torch; ``plan_drive.py`` builds
on it, and ``plan.py`` puts both together.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["MODES", "Config", "Inputs", "activation_bytes_per_layer", "best_config", "evaluate",
           "head_activation_bytes", "max_micro_batch", "model_state_bytes"]

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


def head_activation_bytes(seq: int, hidden: int, vocab: int, micro_batch: int = 1, *, dtype_bytes: int = 2,
                          loss_chunk: int = 0) -> int:
    """Bytes saved around the LM head: final LayerNorm and head inputs, fp32 log-softmax (4sbV; with a
    chunked loss, one chunk's: 4 x chunk x V)."""
    sb = seq * micro_batch
    logits = min(sb, loss_chunk) if loss_chunk else sb
    return 4 * logits * vocab + 2 * dtype_bytes * sb * hidden


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
    trainable_fraction: float = 1.0
    """Share of the parameters trained (PEFT, LoRA: about 0.01): frozen ones hold no gradient and
    no optimizer state."""
    optimizer_bytes: float | None = None
    """Bytes of optimizer state per trained parameter; ``None``: ``BYTES_PER_PARAM`` less the weight
    and its gradient (fp32 master weights and two fp32 AdamW moments: 12 in bf16). AdamW with its
    moments in the weights' dtype and no master copy, as the bench trains: 4 in bf16."""
    zero: int = 0
    """Model states sharded over the data-parallel ranks: 0 none; 1 optimizer states; 2 and
    gradients; 3 and weights (FSDP's full sharding, ZeRO-3)."""
    loss_chunk: int = 0
    """Tokens per chunk of a chunked loss (a fused linear cross-entropy, Liger's): one chunk's
    fp32 logits are held instead of the whole sequence's; 0: the whole logits."""
    host_gbps: float = 25.0
    """The host tier's copy rate between a GPU and pinned host memory, GB/s each way (PCIe 4.0 x16
    carries about 25; an H100's PCIe 5.0 measured 54); 0: no host tier."""
    host_gib: float = 64.0
    """Pinned host memory per GPU for the tier (the offloader's ``host_bytes``; its default is a
    quarter of the RAM available divided among the local ranks: 64 GiB on a machine of 2 TB and
    8 GPUs); 0: no host tier."""

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
        if not 0 < self.trainable_fraction <= 1:
            raise ValueError(f"--trainable-fraction must be in (0, 1], got {self.trainable_fraction!r}")
        if self.optimizer_bytes is not None and not self.optimizer_bytes >= 0:
            raise ValueError(f"--optimizer-bytes must be >= 0, got {self.optimizer_bytes!r}")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"--zero must be 0, 1, 2 or 3, got {self.zero!r}")
        for name in ("host_gbps", "host_gib"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0 (0: no host tier), got {getattr(self, name)!r}")
        if not isinstance(self.loss_chunk, int) or self.loss_chunk < 0:
            raise ValueError(f"--loss-chunk must be an integer >= 0, got {self.loss_chunk!r}")
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
    def host_tier(self) -> bool:
        return self.host_gbps > 0 and self.host_gib > 0

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


def model_state_bytes(inp: Inputs, params: int, dp: int) -> float:
    """Bytes of model states per GPU for ``params`` parameters: weights (``d`` bytes each), and for
    the trained share their gradients (``d``) and optimizer state (``optimizer_bytes``; by default
    fp32 master weights and two AdamW moments: the rest of ``BYTES_PER_PARAM``), each divided over
    the ``dp`` data-parallel ranks as ``--zero`` shards it."""
    d = inp.dtype_bytes
    opt = BYTES_PER_PARAM - 2 * d if inp.optimizer_bytes is None else inp.optimizer_bytes
    shard = [dp if inp.zero >= level else 1 for level in (3, 2, 1)]  # weights, gradients, optimizer
    per_param = d / shard[0] + inp.trainable_fraction * (d / shard[1] + opt / shard[2])
    return params * per_param


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
    dp = max(1, inp.gpus // p)
    first = model_state_bytes(inp, layers * _layer_params(h) + embed, dp) + first_act
    head_act = head_activation_bytes(s, h, v, b, dtype_bytes=d, loss_chunk=inp.loss_chunk)
    last = model_state_bytes(inp, layers * _layer_params(h) + (v * h if p > 1 else 0), dp) + last_act + head_act
    return first + head_act if p == 1 else max(first, last)


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




def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


