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

With ``tile="heads"`` (``head_groups``), steps 1 and 2 run a group of query heads at a time, with
the key/value heads the group shares (:func:`ssdtrain.longctx.head_groups.grouped_layer`): q, k, v,
their gradients and the group's part of attention exist for one group at a time; of the whole
sequence the layer keeps its input, attention's output and log-sum-exp. A plain ``nn.Linear``
projection computes only its group's rows; another (PEFT's, with adapters), or one with forward
hooks (ZeRO-3 gathers its weight in one), computes all of them and the group's are kept (its
adapters and hooks run, as always). On the CPU, with SDPA, no mask (causal
alone, as transformers passes it without padding) and no dropout, attention's gradients come from
the fused kernel's own backward; otherwise from the model's attention function run again for the
group in backward (one attention forward more).

The modules stay where they are (parameter names, state dicts, PEFT's adapters inside the
projections: each tile calls the projection module, adapters and all). Evaluation, generation (a
cache), forwards without gradients and attention weights asked for run the layer's own forward.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.modules import module as _torch_module  # its global forward hooks (_hooked)

from ssdtrain.longctx.tiled import replace_forward, tile_bounds
from ssdtrain.longctx.tiled_layer import params_of, tiled_parts

__all__ = ["check_head_groups", "tile_layer_in_place"]


def tile_layer_in_place(layer: nn.Module, tile_tokens: int | None, head_groups: int | None = None,
                        layer_memory: int | None = None) -> Any:
    """Tiles ``layer`` (a ``*DecoderLayer`` with ``self_attn``, ``mlp``, ``input_layernorm`` and
    ``post_attention_layernorm``); returns the function that undoes it. ``head_groups``: attention a
    group of query heads at a time, in that many groups (a divisor of the key/value heads).
    ``layer_memory`` (with ``head_groups``): fewer groups and longer tiles at each sequence length
    where the layer's backward fits that many bytes (:mod:`ssdtrain.longctx.sizing`)."""
    attn = layer.self_attn
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling", "config"):
        if not hasattr(attn, name):
            raise ValueError(f"{type(layer).__name__}.self_attn has no {name}: not a layer tile='layer' knows")
    if head_groups is not None:
        check_head_groups(attn.config, head_groups)
    if getattr(layer.forward, "_ssdtrain_tiled", False):
        raise ValueError(f"{type(layer).__name__} is already tiled")
    original = layer.forward
    module = sys.modules[type(attn).__module__]  # the family's apply_rotary_pos_emb and attention functions

    def forward(hidden_states: torch.Tensor, attention_mask: Any = None, position_ids: Any = None,
                past_key_values: Any = None, use_cache: Any = False, position_embeddings: Any = None,
                **kwargs: Any) -> Any:
        own = (not torch.is_grad_enabled() or past_key_values is not None or use_cache or position_embeddings is None
               or kwargs.get("output_attentions"))
        tile, groups = tile_tokens, head_groups
        if not own and layer_memory is not None and head_groups is not None:
            own, tile, groups = _sized(attn, hidden_states, tile_tokens, head_groups, layer_memory)  # whole: it fits
        if own:
            return original(hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                            past_key_values=past_key_values, use_cache=use_cache,
                            position_embeddings=position_embeddings, **kwargs)
        return _tiled_forward(layer, module, tile, groups, hidden_states, attention_mask,
                              position_embeddings, dict(kwargs, position_ids=position_ids, use_cache=use_cache))

    forward._ssdtrain_tiled = True  # type: ignore[attr-defined]
    return replace_forward(layer, forward)


def _sized(attn: nn.Module, x: torch.Tensor, tile_tokens: int | None, head_groups: int, memory: int) -> Any:
    from ssdtrain.longctx.sizing import sized_heads

    c, (b, s, h) = attn.config, x.shape
    return sized_heads(s, b, hidden=h, heads=c.num_attention_heads, kv_heads=c.num_key_value_heads,
                       ffn_hidden=c.intermediate_size, dtype_bytes=x.element_size(), memory=memory,
                       tile_tokens=tile_tokens or h, head_groups=head_groups,
                       flash=c._attn_implementation != "eager")


def check_head_groups(config: Any, groups: Any) -> None:
    """``groups`` divides the query heads, and is a divisor or a multiple of the key/value heads (a
    group is whole key/value heads with their query heads, or some of one's query heads)."""
    from ssdtrain.longctx.sizing import group_choices

    heads, kv = config.num_attention_heads, config.num_key_value_heads
    if isinstance(groups, bool) or not isinstance(groups, int) or groups not in group_choices(heads, kv):
        raise ValueError(f"head_groups must be a positive int dividing the model's {heads} query heads and a "
                         f"divisor or a multiple of its {kv} key/value heads, got {groups!r}")


class _OneKeyHeadEach:
    """The attention module as its attention function sees it, with ``num_key_value_groups`` 1: a
    group smaller than a key/value head's queries hands it k and v already repeated."""

    def __init__(self, attn: nn.Module) -> None:
        self.__dict__["_attn"] = attn

    def __getattr__(self, name: str) -> Any:
        return 1 if name == "num_key_value_groups" else getattr(self._attn, name)


def _attention_function(attn: nn.Module, module: Any) -> Any:
    impl = attn.config._attn_implementation
    eager = module.eager_attention_forward
    table = module.ALL_ATTENTION_FUNCTIONS
    if hasattr(table, "get_interface"):
        return table.get_interface(impl, eager)
    return eager if impl == "eager" else table[impl]


def _tiled_forward(layer: nn.Module, module: Any, tile_tokens: int | None, head_groups: int | None, x: torch.Tensor,
                   mask: Any, position_embeddings: tuple[torch.Tensor, torch.Tensor], kwargs: dict) -> torch.Tensor:
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
    post_params = params_of(attn.o_proj, layer.post_attention_layernorm, layer.mlp)
    extra = dict(kwargs)  # what the layer's attention module hands its attention function
    if hasattr(attn, "sliding_window"):  # Qwen2, Qwen3: per layer
        extra["sliding_window"] = attn.sliding_window
    elif getattr(attn.config, "model_type", None) == "mistral":
        extra["sliding_window"] = getattr(attn.config, "sliding_window", None)
    dropout = attn.attention_dropout if attn.training else 0.0
    function = _attention_function(attn, module)
    inputs = (x, cos.expand(b, -1, -1), sin.expand(b, -1, -1))
    if head_groups is not None:
        return _grouped_forward(layer, module, function, head_groups, inputs, mask, dropout, extra, post,
                                pre_params, post_params, bounds)
    q, k, v = tiled_parts(pre, inputs, pre_params, bounds)
    y, _ = function(attn, q, k, v, mask, dropout=dropout, scaling=attn.scaling, **extra)
    # y: (batch, seq, heads, head_dim); the tiles take it with the sequence at -2, as a view
    (z,) = tiled_parts(post, (x, y.transpose(1, 2)), post_params, bounds)
    return z


def _rows(proj: nn.Module, n: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Output features ``[lo, hi)`` of ``proj(n)``: a plain ``nn.Linear`` without forward hooks
    computes only those; any other module computes all and they are kept: PEFT's (with its
    adapters), and one with hooks, which must run (DeepSpeed ZeRO-3 gathers a module's sharded
    weight in its forward pre-hook: the weight itself is then an empty placeholder)."""
    if type(proj) is nn.Linear and not _hooked(proj):
        return F.linear(n, proj.weight[lo:hi], None if proj.bias is None else proj.bias[lo:hi])
    return proj(n)[..., lo:hi]


def _hooked(module: nn.Module) -> bool:
    """Whether calling ``module`` runs a forward hook (its own, or one registered for every module)."""
    return bool(module._forward_hooks or module._forward_pre_hooks or _torch_module._global_forward_hooks
                or _torch_module._global_forward_pre_hooks)


def _grouped_forward(layer: nn.Module, module: Any, function: Any, groups: int, inputs: tuple, mask: Any,
                     dropout: float, extra: dict, post: Any, pre_params: tuple, post_params: tuple,
                     bounds: tuple) -> torch.Tensor:
    """The layer with attention ``groups`` groups of query heads at a time (module docstring)."""
    from ssdtrain.longctx.head_groups import group_heads, group_tiles, grouped_layer, kernel_available

    attn = layer.self_attn
    b, d = inputs[0].shape[0], attn.head_dim
    heads, kv = attn.config.num_attention_heads, attn.config.num_key_value_heads
    rep = heads // kv  # query heads a key/value head
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)  # Qwen3: per head

    def part(lo: int, hi: int, g: int, xt: torch.Tensor, ct: torch.Tensor, st: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n = layer.input_layernorm(xt)
        shape = (b, hi - lo, -1, d)
        qs, ks = group_heads(heads, kv, groups, g)
        q = _rows(attn.q_proj, n, qs.start * d, qs.stop * d).view(shape)
        k = _rows(attn.k_proj, n, ks.start * d, ks.stop * d).view(shape)
        if q_norm is not None:
            q, k = q_norm(q), k_norm(k)
        v = _rows(attn.v_proj, n, ks.start * d, ks.stop * d).view(shape).transpose(1, 2)
        q, k = module.apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), ct, st)
        return q, k, v

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        seen = attn
        if q.shape[1] < rep:  # a group smaller than a key/value head's queries: k and v repeated here
            k, v, seen = k.expand(-1, q.shape[1], -1, -1), v.expand(-1, q.shape[1], -1, -1), _OneKeyHeadEach(attn)
        y, _ = function(seen, q, k, v, mask, dropout=dropout, scaling=attn.scaling, **extra)
        return y.transpose(1, 2)  # (batch, heads, seq, head_dim)

    kernel = (kernel_available(inputs[0].device) and attn.config._attn_implementation == "sdpa" and mask is None
              and dropout == 0.0 and extra.get("sliding_window") is None)
    return grouped_layer(part, post, inputs, pre_params, post_params, bounds, groups, kv, scale=attn.scaling,
                         attend=None if kernel else attend, part_bounds=group_tiles(bounds, groups), random=dropout > 0)
