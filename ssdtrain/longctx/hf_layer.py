"""A Hugging Face decoder layer (Llama, Mistral, Qwen2, Qwen3) computed whole in sequence tiles:
``long_context(model, tile="layer")``.

The layer's forward is replaced (an instance attribute, undone by ``LongContext.undo``) by one
that runs, with the layer's own modules and the model's own attention implementation:

1. the input norm, the q/k/v projections (Qwen3's per-head q/k norms too) and the rotary positions,
   a tile of positions at a time (:func:`ssdtrain.longctx.tiled_layer.tiled_parts`);
2. attention over the whole sequence, through ``config._attn_implementation`` as the model's own
   attention module calls it (its mask, scaling, sliding window and dropout);
3. the o-projection, the residual, the post-attention norm, the MLP and the second residual, a
   tile at a time.

The modules stay where they are (parameter names, state dicts, PEFT's adapters inside the
projections: each tile calls the projection module, adapters and all). Evaluation, generation (a
cache), forwards without gradients and attention weights asked for run the layer's own forward.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from ssdtrain.longctx.tiled import replace_forward, tile_bounds
from ssdtrain.longctx.tiled_layer import params_of, tiled_parts

__all__ = ["tile_layer_in_place"]


def tile_layer_in_place(layer: nn.Module, tile_tokens: int | None) -> Any:
    """Tiles ``layer`` (a ``*DecoderLayer`` with ``self_attn``, ``mlp``, ``input_layernorm`` and
    ``post_attention_layernorm``); returns the function that undoes it."""
    attn = layer.self_attn
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling", "config"):
        if not hasattr(attn, name):
            raise ValueError(f"{type(layer).__name__}.self_attn has no {name}: not a layer tile='layer' knows")
    if getattr(layer.forward, "_ssdtrain_tiled", False):
        raise ValueError(f"{type(layer).__name__} is already tiled")
    original = layer.forward
    module = sys.modules[type(attn).__module__]  # the family's apply_rotary_pos_emb and attention functions

    def forward(hidden_states: torch.Tensor, attention_mask: Any = None, position_ids: Any = None,
                past_key_values: Any = None, use_cache: Any = False, position_embeddings: Any = None,
                **kwargs: Any) -> Any:
        if (not torch.is_grad_enabled() or past_key_values is not None or use_cache or position_embeddings is None
                or kwargs.get("output_attentions")):
            return original(hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                            past_key_values=past_key_values, use_cache=use_cache,
                            position_embeddings=position_embeddings, **kwargs)
        return _tiled_forward(layer, module, tile_tokens, hidden_states, attention_mask, position_embeddings,
                              dict(kwargs, position_ids=position_ids, use_cache=use_cache))

    forward._ssdtrain_tiled = True  # type: ignore[attr-defined]
    return replace_forward(layer, forward)


def _attention_function(attn: nn.Module, module: Any) -> Any:
    impl = attn.config._attn_implementation
    eager = module.eager_attention_forward
    table = module.ALL_ATTENTION_FUNCTIONS
    if hasattr(table, "get_interface"):
        return table.get_interface(impl, eager)
    return eager if impl == "eager" else table[impl]


def _tiled_forward(layer: nn.Module, module: Any, tile_tokens: int | None, x: torch.Tensor, mask: Any,
                   position_embeddings: tuple[torch.Tensor, torch.Tensor], kwargs: dict) -> torch.Tensor:
    attn = layer.self_attn
    b, s, h = x.shape
    d = attn.head_dim
    cos, sin = position_embeddings  # (batch, seq, head_dim)
    bounds = tile_bounds(s, tile_tokens=tile_tokens, default_tokens=h)
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)  # Qwen3

    # The rotary tables are inputs of the tiled part, not captured by it: saved as the layer's own
    # saves are (an offloader takes them), not held by the part until backward.
    def pre(lo: int, hi: int, xt: torch.Tensor, ct: torch.Tensor, st: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n = layer.input_layernorm(xt)
        shape = (b, hi - lo, -1, d)
        q, k = attn.q_proj(n).view(shape), attn.k_proj(n).view(shape)
        if q_norm is not None:
            q, k = q_norm(q), k_norm(k)
        v = attn.v_proj(n).view(shape).transpose(1, 2)
        q, k = module.apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), ct, st)
        return q, k, v

    def post(lo: int, hi: int, xt: torch.Tensor, yt: torch.Tensor) -> tuple[torch.Tensor]:
        r = xt + attn.o_proj(yt.transpose(1, 2).reshape(b, hi - lo, -1))
        return (r + layer.mlp(layer.post_attention_layernorm(r)),)

    pre_params = params_of(layer.input_layernorm, attn.q_proj, attn.k_proj, attn.v_proj,
                           *(m for m in (q_norm, k_norm) if m is not None))
    q, k, v = tiled_parts(pre, (x, cos.expand(b, -1, -1), sin.expand(b, -1, -1)), pre_params, bounds)
    extra = dict(kwargs)  # what the layer's attention module hands its attention function
    if hasattr(attn, "sliding_window"):  # Qwen2, Qwen3: per layer
        extra["sliding_window"] = attn.sliding_window
    elif getattr(attn.config, "model_type", None) == "mistral":
        extra["sliding_window"] = getattr(attn.config, "sliding_window", None)
    y, _ = _attention_function(attn, module)(attn, q, k, v, mask, dropout=attn.attention_dropout if attn.training
                                             else 0.0, scaling=attn.scaling, **extra)
    # y: (batch, seq, heads, head_dim); the tiles take it with the sequence at -2, as a view
    (z,) = tiled_parts(post, (x, y.transpose(1, 2)), params_of(attn.o_proj, layer.post_attention_layernorm,
                                                               layer.mlp), bounds)
    return z
