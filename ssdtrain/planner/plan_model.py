"""The memory and time model of ``ssdtrain plan`` (stated in ``plan.py``'s docstring): model states,
activations and the step per pipeline configuration. Pure Python, no torch; ``plan_drive.py`` builds
on it, and ``plan.py`` puts both together.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["ARCHS", "MODES", "OPTIMIZERS", "Config", "Inputs", "activation_bytes_per_layer", "best_config",
           "block_working_bytes", "evaluate", "head_activation_bytes", "layer_forward_flops",
           "llama_activation_bytes_per_layer", "max_micro_batch", "model_state_bytes"]

MODES = ("baseline", "recompute", "offload")
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
BYTES_PER_PARAM = 16
RESERVE_FRACTION = 0.10
OFFLOAD_RESIDENT_LAYERS = 2
GIB = 1 << 30
ARCHS = ("gpt", "llama")
OPTIMIZERS = ("adamw", "adamw8bit", "offloaded")
"""``--optimizer``: bytes per trained parameter beside its weight and gradient (``d`` each), where
``master`` is an fp32 master weight in 16-bit training (4 bytes; none in fp32):

* ``adamw``: master + two fp32 moments = 12 in bf16: 16 a parameter in all (``BYTES_PER_PARAM``);
* ``adamw8bit`` (bitsandbytes' 8-bit AdamW): master + two 1-byte moments = 6: 10 in all (its
  block-wise scales, 8 bytes per 2048 values, are left out);
* ``offloaded`` (the optimizer step on the CPU: DeepSpeed's ZeRO-Offload, torchao's
  ``CPUOffloadOptimizer``): nothing on the GPU, 4 in all; master and moments (12) in host memory."""
MODES_TILED = ("recompute+tiled", "recompute+offload", "recompute+offload+tiled")
"""The long-context modes ``_stage_memory`` also knows (``plan_longctx.py``): ``+tiled`` the MLP run a
tile of ``tile_tokens`` positions at a time (``ssdtrain.longctx``); ``+offload`` every block input
off the GPU (host tier, then drives) but ``CKPT_RESIDENT`` in flight."""
CKPT_RESIDENT = 1
"""Block inputs on the GPU under ``recompute+offload`` beside the recomputed block's own: the one
being copied out in forward, or read back ahead of its block in backward."""


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
    8 GPUs); 0: no host tier. ``node_host_gib`` replaces it with a node's share."""
    arch: str = "gpt"
    """``gpt``: Korthikanti's layer (LayerNorm, GELU MLP of 4h, learned positions, tied head,
    dropout as ``dropout`` says). ``llama``: RMSNorm, RoPE, grouped-query attention (``kv_heads``),
    SwiGLU MLP of ``ffn_hidden``, no dropout, an untied head."""
    kv_heads: int | None = None
    """Key/value heads (grouped-query attention; ``llama`` only); ``None``: ``heads``."""
    ffn_hidden: int | None = None
    """The MLP's inner width; ``None``: 4h for ``gpt``, Llama's ``8h/3`` rounded up to 256 for ``llama``."""
    tile_tokens: int | None = None
    """Positions per MLP tile in the ``+tiled`` modes; ``None``: the hidden size (``ssdtrain.longctx``'s default)."""
    optimizer: str = "adamw"
    """``OPTIMIZERS``: the optimizer state per trained parameter, unless ``optimizer_bytes`` says it."""
    gpus_per_node: int | None = None
    """GPUs sharing a node's host memory; ``None``: ``min(gpus, 8)``."""
    node_host_gib: float | None = None
    """Pinned host memory of a node for the tier, all its GPUs together: if given, each GPU's share,
    ``node_host_gib / gpus_per_node``, replaces ``host_gib``."""

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"--arch must be one of {ARCHS}, got {self.arch!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"--optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        for name in ("kv_heads", "ffn_hidden", "tile_tokens", "gpus_per_node"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if self.node_host_gib is not None and not self.node_host_gib >= 0:
            raise ValueError(f"--node-host-gib must be >= 0, got {self.node_host_gib!r}")
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
        # Defaults resolved here, so that the JSON and ``replace`` carry the values used.
        if self.arch == "gpt":
            if self.kv_heads not in (None, self.heads) or self.ffn_hidden not in (None, 4 * self.hidden):
                raise ValueError("--kv-heads and --ffn-hidden describe a Llama block: give --arch llama "
                                 "(the gpt layer has as many key/value heads as heads and an MLP of 4 x hidden)")
            ffn = 4 * self.hidden
        else:
            ffn = self.ffn_hidden or -(-8 * self.hidden // 3 // 256) * 256
        kv_heads = self.kv_heads or self.heads
        if self.heads % kv_heads:
            raise ValueError(f"--heads ({self.heads}) must be divisible by --kv-heads ({kv_heads})")
        object.__setattr__(self, "kv_heads", kv_heads)
        object.__setattr__(self, "ffn_hidden", ffn)
        object.__setattr__(self, "tile_tokens", self.tile_tokens or self.hidden)
        object.__setattr__(self, "gpus_per_node", self.gpus_per_node or min(self.gpus, 8))
        if self.node_host_gib is not None:
            object.__setattr__(self, "host_gib", self.node_host_gib / self.gpus_per_node)
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

    @property
    def kv_dim(self) -> int:
        """Width of k and of v: ``hidden x kv_heads / heads``."""
        return self.hidden * self.kv_heads // self.heads

    @property
    def _master_bytes(self) -> int:
        return 4 if self.dtype_bytes < 4 else 0

    @property
    def optimizer_gpu_bytes(self) -> float:
        """Optimizer state on the GPU per trained parameter (``OPTIMIZERS``; ``optimizer_bytes`` if given)."""
        if self.optimizer_bytes is not None:
            return self.optimizer_bytes
        return {"adamw": self._master_bytes + 8, "adamw8bit": self._master_bytes + 2, "offloaded": 0}[self.optimizer]

    @property
    def optimizer_host_bytes(self) -> float:
        """Optimizer state in host memory per trained parameter: ``offloaded``'s master and moments."""
        return self._master_bytes + 8 if self.optimizer == "offloaded" and self.optimizer_bytes is None else 0

    def act_layer(self, micro_batch: int) -> int:
        if self.arch == "llama":
            return llama_activation_bytes_per_layer(
                self.seq, self.hidden, self.heads, self.kv_heads, self.ffn_hidden, micro_batch,
                dtype_bytes=self.dtype_bytes, flash=self.flash)
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


def layer_params(inp) -> int:
    """Parameters of one block: ``gpt`` as :func:`_layer_params`; ``llama``: q and o ``2h²``, k and v
    ``2h·kv``, gate, up and down ``3hf``, two RMSNorms ``2h``, no biases."""
    h = inp.hidden
    if inp.arch == "gpt":
        return _layer_params(h)
    return 2 * h * h + 2 * h * inp.kv_dim + 3 * h * inp.ffn_hidden + 2 * h


def model_params(inp) -> int:
    """All parameters: the blocks, the embeddings and the head (``llama``: untied, and the final
    RMSNorm; ``gpt``: learned positions, the head tied to the embedding)."""
    h, v = inp.hidden, inp.vocab
    extra = (v + inp.seq) * h if inp.arch == "gpt" else 2 * v * h + h
    return inp.layers * layer_params(inp) + extra


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


def _stage_memory(inp: Inputs, mode: str, p: int, b: int, m: int, offload_fraction: float = 1.0) -> float:
    """Peak bytes on the busier of the first and last pipeline stage: model states, what the mode
    keeps through the step (``first``/``last``: saves or checkpoints), and what one block's backward
    adds (``work``: its gradients; under checkpointing the recomputed block, ``block_working_bytes``).

    The head's saves and one chunk's logits (``head_activation_bytes``) come on top of that for
    ``gpt`` (as the model always counted them). For ``llama`` the head's backward comes first and
    frees them before any block's backward: the last stage's peak is the larger of the head's
    moment (its saves and the gradient of its input, ``dsbh``) and a block's."""
    s, h, v, d = inp.seq, inp.hidden, inp.vocab, inp.dtype_bytes
    layers = math.ceil(inp.layers / p)
    inflight = min(m, p)
    act = inp.act_layer(b)
    ckpt = d * s * b * h  # one block's input: what checkpointing keeps
    # Llama's working set counts the recomputed block's input, which is one of the checkpoints: once.
    # (gpt: Korthikanti's layer counts its LayerNorm input too; kept as it was, counted twice.)
    own_input = ckpt if inp.arch == "llama" else 0
    if mode == "baseline":
        work = _backward_grad_bytes(inp, b)
        first_keep, last_keep = layers * inflight * act, layers * act
    elif mode in ("recompute", "recompute+tiled"):
        work = block_working_bytes(inp, b, tiled=mode == "recompute+tiled") - own_input
        first_keep, last_keep = layers * inflight * ckpt, layers * ckpt
    elif mode in ("recompute+offload", "recompute+offload+tiled"):
        # Every block input leaves the GPU (host tier, then drives) but the ones in flight.
        work = block_working_bytes(inp, b, tiled=mode.endswith("+tiled")) - own_input
        first_keep = last_keep = min(layers, 1 + CKPT_RESIDENT) * ckpt
    elif mode == "offload":
        # A fraction f of the activations goes to the drive; the rest stays like baseline's.
        work = _backward_grad_bytes(inp, b)
        window = min(layers, OFFLOAD_RESIDENT_LAYERS) * act if offload_fraction > 0 else 0
        first_keep = (1 - offload_fraction) * layers * inflight * act + window
        last_keep = (1 - offload_fraction) * layers * act + window
    else:
        raise ValueError(f"unknown mode {mode!r}; choose one of {MODES + MODES_TILED}")
    head_act = head_activation_bytes(s, h, v, b, dtype_bytes=d, loss_chunk=inp.loss_chunk)
    if inp.arch == "gpt":
        embed, head = (v + s) * h, (v * h if p > 1 else 0)  # learned positions; the head tied
        last_peak = work + head_act
    else:
        embed, head = v * h, v * h + h  # untied head and the final RMSNorm
        last_peak = max(work, head_act + ckpt)
    dp = max(1, inp.gpus // p)
    block = layers * layer_params(inp)
    if p == 1:
        return model_state_bytes(inp, block + embed + (head if inp.arch != "gpt" else 0), dp) + first_keep + last_peak
    first = model_state_bytes(inp, block + embed, dp) + first_keep + work
    last = model_state_bytes(inp, block + head, dp) + last_keep + last_peak
    return max(first, last)


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
    fwd_layer = layer_forward_flops(inp)
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
