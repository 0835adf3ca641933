"""What ``ssdtrain plan`` is asked about: :class:`Inputs`, its flags' checks and the defaults it
resolves (a Llama block's key/value heads and MLP width, the MLP tile, a node's host memory per GPU),
and the bytes per parameter its optimizer keeps. Pure Python, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from ssdtrain.planner.plan_layer import activation_bytes_per_layer, llama_activation_bytes_per_layer

__all__ = ["ARCHS", "BYTES_PER_PARAM", "DTYPE_BYTES", "OPTIMIZERS", "Inputs"]

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
BYTES_PER_PARAM = 16
ARCHS = ("gpt", "llama")
OPTIMIZERS = ("adamw", "adamw8bit", "offloaded")
"""``--optimizer``: bytes per trained parameter beside its weight and gradient (``d`` each), where
``master`` is an fp32 master weight in 16-bit training (4 bytes; none in fp32):

* ``adamw``: master + two fp32 moments = 12 in bf16: 16 a parameter in all (``BYTES_PER_PARAM``);
* ``adamw8bit`` (bitsandbytes' 8-bit AdamW): master + two 1-byte moments = 6: 10 in all (its
  block-wise scales, 8 bytes per 2048 values, are left out);
* ``offloaded`` (the optimizer step on the CPU: DeepSpeed's ZeRO-Offload, torchao's
  ``CPUOffloadOptimizer``): nothing on the GPU, 4 in all; master and moments (12) in host memory."""


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
    """Positions per tile in the ``+tiled`` modes (the MLP's) and the ``+tiled-layer`` modes (every
    position-wise part's); ``None``: the hidden size (``ssdtrain.longctx``'s default)."""
    head_groups: int | None = None
    """Groups of query heads attention runs one at a time in the ``+tiled-heads`` modes (``llama``);
    ``None``: one per key/value head. A multiple of ``kv_heads`` dividing ``heads``."""
    optimizer: str = "adamw"
    """``OPTIMIZERS``: the optimizer state per trained parameter, unless ``optimizer_bytes`` says it."""
    gpus_per_node: int | None = None
    """GPUs sharing a node's host memory; ``None``: ``min(gpus, 8)``."""
    node_host_gib: float | None = None
    """Pinned host memory of a node for the tier, all its GPUs together: if given, each GPU's share,
    ``node_host_gib / gpus_per_node``, replaces ``host_gib``."""
    tied_head: bool = True
    """``gpt``: the head shares the embedding's weight (at more than one stage the last holds a copy);
    ``False``: the head is a weight of its own (Megatron-Core's
    ``share_embeddings_and_output_weights=False``, a plain ``nn.Linear``). ``llama``'s is untied."""
    virtual_stages: int = 1
    """Model chunks a pipeline stage may hold under Megatron-Core's interleaved 1F1B (its
    ``--virtual-pipeline-model-parallel-size``): with more than 1 the planner also weighs that many
    chunks a stage wherever the stage's layers divide into them and the micro-batches are a multiple
    of the stages. 1: plain 1F1B only (DeepSpeed's PipelineEngine has no interleaving)."""
    allreduce_gbps: float = 0.0
    """Bus bandwidth of the data-parallel ranks' gradient all-reduce, GB/s (what ``nccl-tests``
    reports as busbw): a step adds ``2 (dp - 1)/dp`` times a stage's gradient bytes over it. 0: not
    modelled (the pipeline's time only)."""
    tflops_at: tuple = ()
    """Achieved TFLOPS measured per micro-batch size, ``((b, tflops), ...)`` (``--tflops-at
    1:0.031,2:0.040``): small micro-batches run a GPU (and a CPU) below its best rate. A size between
    two measured ones takes the straight line between their rates, one outside them the nearest
    measured rate. Empty: ``tflops`` at every size."""

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"--arch must be one of {ARCHS}, got {self.arch!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"--optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        for name in ("kv_heads", "ffn_hidden", "tile_tokens", "gpus_per_node", "head_groups"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if not isinstance(self.virtual_stages, int) or self.virtual_stages < 1:
            raise ValueError(f"--virtual-stages must be a positive integer, got {self.virtual_stages!r}")
        object.__setattr__(self, "tflops_at", _rates(self.tflops_at))
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
        if not self.allreduce_gbps >= 0:
            raise ValueError(f"--allreduce-gbps must be >= 0 (0: not modelled), got {self.allreduce_gbps!r}")
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
        groups = self.head_groups or kv_heads
        if self.heads % groups or groups % kv_heads:
            raise ValueError(f"--head-groups ({groups}) must divide --heads ({self.heads}) and be a multiple of "
                             f"the key/value heads ({kv_heads})")
        object.__setattr__(self, "head_groups", groups)
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

    def rate(self, micro_batch: int) -> float:
        """Achieved TFLOPS at ``micro_batch``: ``tflops_at`` where measured (interpolated between
        sizes, the nearest outside them), else ``tflops``."""
        at = self.tflops_at
        if not at:
            return self.tflops
        if micro_batch <= at[0][0]:
            return at[0][1]
        for (b0, r0), (b1, r1) in zip(at, at[1:]):
            if micro_batch <= b1:
                return r0 + (r1 - r0) * (micro_batch - b0) / (b1 - b0)
        return at[-1][1]

    def backward_rate(self, micro_batch: int) -> float:
        """Achieved TFLOPS in backward at ``micro_batch``: ``rate(micro_batch)`` scaled by
        ``backward_tflops / tflops`` when ``backward_tflops`` is given."""
        return self.rate(micro_batch) * (self.backward_tflops / self.tflops if self.backward_tflops else 1.0)

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


def _rates(pairs) -> tuple:
    """``tflops_at`` checked and sorted by micro-batch size: ``((b, tflops), ...)``."""
    out = {}
    for pair in pairs:
        try:
            b, r = pair
        except (TypeError, ValueError):
            raise ValueError(f"--tflops-at: each entry is a micro-batch size and its TFLOPS (1:0.03), got {pair!r}") from None
        if not isinstance(b, int) or isinstance(b, bool) or b < 1:
            raise ValueError(f"--tflops-at: a micro-batch size must be a positive integer, got {b!r}")
        if not (isinstance(r, (int, float)) and r > 0):
            raise ValueError(f"--tflops-at: the TFLOPS at micro-batch {b} must be > 0, got {r!r}")
        if b in out:
            raise ValueError(f"--tflops-at: micro-batch {b} given twice")
        out[b] = float(r)
    return tuple(sorted(out.items()))
