"""A small GPT-style decoder in plain PyTorch, the model ``ssdtrain bench`` trains.

It is deliberately ordinary: pre-LayerNorm blocks with causal self-attention and a 4h GELU MLP,
a tied LM head. The blocks sit in an ``nn.ModuleList`` named ``blocks`` so that the offloader's
layer scopes (and ``torch.utils.checkpoint`` per block for the ``recompute`` mode) find them.

Example::

    from ssdtrain.bench.models import GPT, GPTConfig, preset
    model = GPT(preset("quick"))
    loss = model(tokens, targets)   # tokens, targets: int64 (batch, seq)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["GPT", "GPTConfig", "Llama", "LlamaConfig", "PRESETS", "chunked_cross_entropy", "make_model", "preset"]


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of the decoder."""

    vocab: int = 8192
    """Vocabulary size (token ids are ``0 .. vocab-1``)."""
    seq: int = 512
    """Longest sequence the position embedding covers."""
    layers: int = 8
    """Number of transformer blocks."""
    hidden: int = 512
    """Model width ``h``."""
    heads: int = 8
    """Attention heads ``a``; must divide ``hidden``."""
    dropout: float = 0.0
    """Dropout probability on attention weights and residual branches (0 adds no mask saves)."""
    flash: bool = True
    """``True``: ``F.scaled_dot_product_attention`` (no s×s tensor saved on the CPU flash kernel);
    ``False``: naive softmax attention that materialises and saves the s×s scores."""
    loss_chunk: int = 0
    """Tokens per chunk of the loss: each chunk's logits are computed, and recomputed in
    backward, under ``torch.utils.checkpoint``, so no more than one chunk's logits (chunk x vocab)
    are ever held; 0: the whole ``(tokens, vocab)`` logits at once (8 GiB at 128k tokens and a
    32k vocabulary in bf16, more than the rest of a step's saves at long sequences)."""

    def __post_init__(self) -> None:
        for name in ("vocab", "seq", "layers", "hidden", "heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        if not isinstance(self.loss_chunk, int) or self.loss_chunk < 0:
            raise ValueError(f"GPTConfig.loss_chunk must be an int >= 0 (0: no chunks), got {self.loss_chunk!r}")
        if self.hidden % self.heads:
            raise ValueError(
                f"GPTConfig.hidden ({self.hidden}) must be divisible by heads ({self.heads})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")

    def replace(self, **changes) -> "GPTConfig":
        """A copy with ``changes`` applied (``None`` values are ignored)."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})


PRESETS: dict[str, GPTConfig] = {
    # Tiny: a whole `ssdtrain bench --quick` (four modes, a few steps each) in seconds.
    "quick": GPTConfig(vocab=512, seq=128, layers=4, hidden=128, heads=4),
    # A step (batch 4, the bench default) takes a few seconds on 2 CPU cores.
    "default": GPTConfig(vocab=8192, seq=512, layers=8, hidden=512, heads=8),
    # The default on a GPU (`ssdtrain bench` where CUDA is): about 0.63 B parameters (3.8 GiB of
    # weights and AdamW state in bfloat16 per mode; the bench holds its five modes side by side)
    # and about 8 GiB of activations at batch 4: some 30 GiB in all, a 40 GiB card or larger.
    # An H100's forward makes those activations far faster than one NVMe drive writes them, the
    # regime offloading meets on GPUs.
    "gpu": GPTConfig(vocab=32768, seq=2048, layers=12, hidden=2048, heads=16),
}


def preset(name: str) -> GPTConfig:
    """The named preset (``quick``, ``default`` or ``gpu``)."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}") from None


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with one fused QKV projection."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.flash = cfg.flash
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)
        if not cfg.flash:
            mask = torch.ones(cfg.seq, cfg.seq, dtype=torch.bool).tril()
            self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).split(h, dim=2)
        # (b, s, a, d) -> (b, a, s, d); views of the one qkv storage.
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        p = self.dropout if self.training else 0.0
        if self.flash:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        else:
            scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))
            scores = scores.masked_fill(~self.causal_mask[:s, :s], float("-inf"))
            att = F.softmax(scores, dim=-1)
            if p:
                att = F.dropout(att, p, training=True)
            y = att @ v
        # The CPU flash kernel returns a transposed view of a (b, s, a, d) buffer, so this
        # reshape is free there and the projection's saved input shares the kernel's output.
        y = y.transpose(1, 2).reshape(b, s, h)
        y = self.proj(y)
        if p:
            y = F.dropout(y, p, training=True)
        return y


class MLP(nn.Module):
    """``h -> 4h -> GELU -> h``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.hidden, 4 * cfg.hidden)
        self.proj = nn.Linear(4 * cfg.hidden, cfg.hidden)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(F.gelu(self.fc(x)))
        if self.dropout and self.training:
            y = F.dropout(y, self.dropout, training=True)
        return y


class Block(nn.Module):
    """Pre-LayerNorm transformer block with residual connections."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def _trunk_and_loss(model: nn.Module, x: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor:
    """The blocks (each checkpointed under ``model.recompute`` in training), the final norm, and the
    logits or the loss (in chunks under ``cfg.loss_chunk``): the part :class:`GPT` and
    :class:`Llama` share after their embeddings."""
    b, s = x.shape[:2]
    for block in model.blocks:
        if model.recompute and model.training and torch.is_grad_enabled():
            x = checkpoint(block, x, use_reentrant=False)
        else:
            x = block(x)
    x = model.ln_f(x)
    if targets is None:
        return model.head(x)
    if model.cfg.loss_chunk and model.training and torch.is_grad_enabled():
        return chunked_cross_entropy(x.reshape(b * s, -1), model.head.weight, targets.reshape(b * s),
                                     model.cfg.loss_chunk)
    return F.cross_entropy(model.head(x).reshape(b * s, -1).float(), targets.reshape(b * s))


class GPT(nn.Module):
    """GPT-style decoder: token + position embeddings, ``blocks``, final LayerNorm, tied head.

    Set ``model.recompute = True`` to run each block under ``torch.utils.checkpoint``
    (``use_reentrant=False``) while training: the block's activations are recomputed in
    backward instead of saved.
    """

    def __init__(self, cfg: GPTConfig | None = None, *, recompute: bool = False) -> None:
        super().__init__()
        self.cfg = cfg or GPTConfig()
        self.recompute = recompute
        self.tok_emb = nn.Embedding(self.cfg.vocab, self.cfg.hidden)
        self.pos_emb = nn.Embedding(self.cfg.seq, self.cfg.hidden)
        self.blocks = nn.ModuleList(Block(self.cfg) for _ in range(self.cfg.layers))
        self.ln_f = nn.LayerNorm(self.cfg.hidden)
        self.head = nn.Linear(self.cfg.hidden, self.cfg.vocab, bias=False)
        self.head.weight = self.tok_emb.weight
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_params(self) -> int:
        """Number of parameters (the tied head counted once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``(batch, seq, vocab)``, or the mean cross-entropy loss if ``targets`` given."""
        s = tokens.shape[1]
        if s > self.cfg.seq:
            raise ValueError(f"sequence length {s} exceeds the model's seq={self.cfg.seq}")
        pos = torch.arange(s, device=tokens.device)
        return _trunk_and_loss(self, self.tok_emb(tokens) + self.pos_emb(pos), targets)


def _chunk_loss(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(h, weight).float(), targets, reduction="sum")


def chunked_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
    """Mean cross-entropy of ``h @ weight.T`` against ``targets`` (``h``: tokens x hidden), a chunk
    of ``chunk`` tokens at a time: each chunk's logits are made under a non-reentrant checkpoint,
    so forward saves only ``h`` (a view per chunk) and backward recomputes one chunk's logits at a
    time. The loss of a fused linear cross-entropy (Liger's on a GPU), in plain PyTorch."""
    total = h.new_zeros((), dtype=torch.float32)
    for i in range(0, h.shape[0], chunk):
        total = total + checkpoint(_chunk_loss, h[i:i + chunk], weight, targets[i:i + chunk], use_reentrant=False)
    return total / h.shape[0]


# --- A Llama-shaped decoder (``ssdtrain bench --max-seq --model llama``) ---------------------------


@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """Shape of the Llama-shaped decoder: RMSNorm, rotary positions, grouped-query attention,
    a SwiGLU MLP, no biases, an untied head (``tie=True``: tied to the embedding)."""

    vocab: int = 256
    seq: int = 512
    """Longest sequence (RoPE has no table to outgrow; kept as the GPT's, which probes replace)."""
    layers: int = 32
    hidden: int = 64
    heads: int = 4
    """Query heads; ``hidden / heads`` (the head size) must be even (RoPE rotates pairs)."""
    kv_heads: int = 0
    """Key/value heads (grouped-query attention); 0: ``heads / 4`` (at least 1), Llama 3's 4 query
    heads per key head."""
    ffn: int = 0
    """The MLP's width; 0: ``3.5 x hidden`` (rounded to a multiple of 8 where it is not whole)."""
    rope_theta: float = 500000.0
    eps: float = 1e-5
    tie: bool = False
    loss_chunk: int = 0
    """As :attr:`GPTConfig.loss_chunk`: the loss a chunk of tokens at a time (0: whole)."""

    def __post_init__(self) -> None:
        for name in ("vocab", "seq", "layers", "hidden", "heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"LlamaConfig.{name} must be a positive int, got {value!r}")
        if self.hidden % self.heads or (self.hidden // self.heads) % 2:
            raise ValueError(f"LlamaConfig: hidden ({self.hidden}) / heads ({self.heads}) must be a whole, even "
                             "head size")
        if self.heads % self.n_kv:
            raise ValueError(f"LlamaConfig: heads ({self.heads}) must be a multiple of kv_heads ({self.n_kv})")
        if not isinstance(self.loss_chunk, int) or self.loss_chunk < 0:
            raise ValueError(f"LlamaConfig.loss_chunk must be an int >= 0, got {self.loss_chunk!r}")

    @property
    def n_kv(self) -> int:
        return self.kv_heads or max(1, self.heads // 4)

    @property
    def n_ffn(self) -> int:
        if self.ffn:
            return self.ffn
        width = 7 * self.hidden / 2
        return int(width) if width == int(width) else (int(width) + 7) // 8 * 8

    def replace(self, **changes) -> "LlamaConfig":
        """A copy with ``changes`` applied (``None`` values are ignored)."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_tables(seq: int, dim: int, theta: float, device, dtype, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``, ``sin`` of shape ``(seq, dim)`` for positions ``start`` to ``start + seq`` (each
    angle twice: the halves rotated together); the rows of positions ``[a, b)`` are the same
    numbers whether made alone or as part of a longer table."""
    inv = _inverse_frequencies(dim, theta, torch.device(device))
    ang = torch.outer(torch.arange(start, start + seq, device=device, dtype=torch.float32), inv)
    ang = torch.cat((ang, ang), dim=-1)
    return ang.cos().to(dtype), ang.sin().to(dtype)


@functools.lru_cache(maxsize=16)
def _inverse_frequencies(dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """RoPE's ``dim / 2`` frequencies (float32), made once per shape: a tiled layer asks for a
    table a tile, a group and a pass at a time."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions, Hugging Face's half-rotation layout; ``x``: ``(b, heads, s, d)``."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class GQAttention(nn.Module):
    """Causal grouped-query attention with rotary positions (SDPA, ``enable_gqa``: the key/value
    heads are not repeated in memory)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.heads, self.kv, self.d = cfg.heads, cfg.n_kv, cfg.hidden // cfg.heads
        self.theta = cfg.rope_theta
        self.q = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.k = nn.Linear(cfg.hidden, self.kv * self.d, bias=False)
        self.v = nn.Linear(cfg.hidden, self.kv * self.d, bias=False)
        self.o = nn.Linear(cfg.hidden, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q = self.q(x).view(b, s, self.heads, self.d).transpose(1, 2)
        k = self.k(x).view(b, s, self.kv, self.d).transpose(1, 2)
        v = self.v(x).view(b, s, self.kv, self.d).transpose(1, 2)
        cos, sin = rope_tables(s, self.d, self.theta, x.device, x.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv != self.heads)
        return self.o(y.transpose(1, 2).reshape(b, s, h))


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``: position-wise, so :mod:`ssdtrain.longctx.tiled` tiles it."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.hidden, cfg.n_ffn, bias=False)
        self.up = nn.Linear(cfg.hidden, cfg.n_ffn, bias=False)
        self.down = nn.Linear(cfg.n_ffn, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.ln1 = RMSNorm(cfg.hidden, cfg.eps)
        self.attn = GQAttention(cfg)
        self.ln2 = RMSNorm(cfg.hidden, cfg.eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Llama(nn.Module):
    """Llama-shaped decoder: token embedding, ``blocks`` (RMSNorm, RoPE, GQA, SwiGLU), final
    RMSNorm, head. ``recompute`` and the chunked loss as :class:`GPT`'s; :func:`tile_mlps` tiles
    its MLPs."""

    def __init__(self, cfg: LlamaConfig | None = None, *, recompute: bool = False) -> None:
        super().__init__()
        self.cfg = cfg or LlamaConfig()
        self.recompute = recompute
        self.tok_emb = nn.Embedding(self.cfg.vocab, self.cfg.hidden)
        self.blocks = nn.ModuleList(LlamaBlock(self.cfg) for _ in range(self.cfg.layers))
        self.ln_f = RMSNorm(self.cfg.hidden, self.cfg.eps)
        self.head = nn.Linear(self.cfg.hidden, self.cfg.vocab, bias=False)
        self.apply(GPT._init_weights)
        if self.cfg.tie:
            self.head.weight = self.tok_emb.weight

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        return _trunk_and_loss(self, self.tok_emb(tokens), targets)


def make_model(cfg: GPTConfig | LlamaConfig) -> nn.Module:
    """The model of ``cfg``'s kind."""
    return Llama(cfg) if isinstance(cfg, LlamaConfig) else GPT(cfg)
