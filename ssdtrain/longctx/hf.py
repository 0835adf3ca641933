"""One call that sets a Hugging Face decoder (Llama, Mistral, Qwen2, Qwen3) up for long context.

::

    from ssdtrain.longctx.hf import long_context

    model = AutoModelForCausalLM.from_pretrained(name, torch_dtype=torch.bfloat16)
    lc = long_context(model, tile_tokens=4096, loss_chunk=4096)    # before PEFT or after it
    off = ssdtrain.Offloader(model, path="/nvme0/act", min_bytes=0)
    with off:
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    lc.undo()                                                      # when done, if ever

or ``Trainer(..., callbacks=[OffloadCallback(path=..., min_bytes=0)])`` after ``long_context``;
or ``long_context(model, offloader=off)``: then every training forward of ``model`` runs inside
``with off:`` by itself (a forward hook, as the Trainer callback's).

What it does, without touching the model's code:

- **Activation checkpointing per decoder layer** (non-reentrant), as
  ``model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant":
  False})`` would (left as it is if already on). The offloader takes each layer's input.
- **Each decoder layer's MLP tiled** along the sequence (:func:`ssdtrain.longctx.tiled.tile_in_place`):
  in the layer recomputed in backward, the SwiGLU intermediates (3 x 3.5 x hidden per token)
  exist for ``tile_tokens`` positions at a time. The modules stay where they are: parameter
  names, state dicts and PEFT's targets are unchanged.
- Or, with ``tile="layer"``, **each decoder layer tiled whole but for attention**
  (:mod:`ssdtrain.longctx.hf_layer`): the norms, q/k/v with the rotary positions, the
  o-projection, both residuals and the MLP, so that in the recomputed layer only what attention
  needs (q, k, v, its output) and the layer's input and output span the sequence.
- Or, with ``tile="heads"``, that and **attention a group of query heads at a time**
  (``head_groups``, one per key/value head by default: :mod:`ssdtrain.longctx.head_groups`): of the
  whole sequence the recomputed layer keeps its input, attention's output and log-sum-exp; q, k, v
  and their gradients exist for one group at a time.
- **The loss in chunks** (:func:`chunked_lm_loss`): in training forwards given ``labels`` the
  model's forward computes the LM head and cross entropy ``loss_chunk`` tokens at a time, each
  chunk under a non-reentrant checkpoint, so no more than one chunk's logits (chunk x vocab, in
  float32) ever exist. It returns ``logits=None`` then; evaluation, generation and forwards
  without labels run the model's own forward. (The loss itself is the model's
  ``ForCausalLMLoss``: labels shifted by one, ``-100`` ignored, the mean over the counted
  tokens or the sum over ``num_items_in_batch``.)

Exactness, float32 on the CPU (``tests/test_longctx_hf.py``): with an offloader the gradients
equal (``torch.equal``) those of the same switched model without one. Against the plain model,
every gradient is equal but those of the MLP weights and the LM head (and of the embedding when
the head is tied to it): a weight's gradient is a sum over tokens, which the tiles and chunks
split into partial sums (about 1e-7 relative); the loss differs by the order of its sum.

Measured on the CPU (a 2-layer Llama of hidden 256, intermediate 896, vocabulary 8192, 2048
tokens, float32, under an offloader with ``min_bytes=0``; the heap's peak above the step's start,
sampled after every op): checkpointing alone 193 MiB, with the loss in chunks of 128 tokens 60
MiB (the recomputed layer's MLP is then the peak), with MLP tiles of 256 positions too 31 MiB.

Why not DeepSpeed ALST's ``TiledFusedLogitsLoss`` or Liger-Kernel's fused linear cross entropy:
both take the gradients in forward. DeepSpeed's adds the head's weight gradient into ``.grad``
during forward and never scales it by the gradient backward brings: ``(loss * 0.5).backward()``
leaves it at twice its value (DeepSpeed 0.19.8; a loss scaler or ``loss / accumulation_steps``
do that). Liger's scales both in backward, but holds them from forward to backward (the hidden
states' gradient, tokens x hidden, and the head's, vocab x hidden: at forward's end, where the
peak is) and needs Triton, a GPU. A checkpoint per chunk costs one more head matmul per chunk and
is exact wherever autograd is. (Liger's ``use_liger_kernel=True`` patches the forward much as here.)

Limits: attention still runs over the whole sequence at once (with SDPA its saves are the layer's
q, k, v and output: about 4 x hidden per token in the recomputed layer); under checkpointing the
tiled MLP runs forward three times (forward, the layer's recomputation, its own backward), as
DeepSpeed ALST's does; the families whose causal-LM forward changes the logits after the head
(Gemma's soft-capping, Granite's scaling, Cohere's logit scale) and MoE MLPs are refused.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ssdtrain.longctx._tiles import partitioned
from ssdtrain.longctx.tiled import replace_forward, tile_bounds, tile_in_place

__all__ = ["LongContext", "SUPPORTED_MODEL_TYPES", "chunked_lm_loss", "long_context"]

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
"""``config.model_type`` of the families whose causal-LM forward is ``lm_head`` then
``ForCausalLMLoss`` and whose decoder layers have a position-wise ``mlp``."""

_MARK = "_ssdtrain_long_context"
_REQUIRE_GRADS_HOOK = "make_inputs_require_grad"
"""How the hooks that make the input embeddings' output require grad are named: transformers'
``make_inputs_require_grads`` (``enable_input_require_grads``), PEFT's ``make_inputs_require_grad``."""
_REQUIRE_GRADS_RECORD = ("_require_grads_hooks", "_require_grads_hook")
"""Where transformers keeps the handles of its latest ``enable_input_require_grads``."""


def _chunk_loss(head: nn.Module, h: torch.Tensor, target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    return F.cross_entropy(head(h).float(), target, ignore_index=ignore_index, reduction="sum")


def chunked_lm_loss(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor | None, *, chunk: int,
                    num_items_in_batch: Any = None, ignore_index: int = -100,
                    shift_labels: torch.Tensor | None = None) -> torch.Tensor:
    """Hugging Face's causal-LM loss of ``head(hidden)``, ``chunk`` tokens at a time.

    Each chunk's logits are made (in float32) and reduced to a summed cross entropy under a
    non-reentrant checkpoint: forward saves only ``hidden`` (a view per chunk), backward makes one
    chunk's logits again at a time. ``labels`` (batch, seq) are shifted by one as
    ``ForCausalLMLoss`` does (or ``shift_labels`` given as they are); the result is the mean over
    the tokens not equal to ``ignore_index``, or the sum over ``num_items_in_batch`` if given.
    """
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a positive int, got {chunk!r}")
    if shift_labels is None:
        if labels is None:
            raise ValueError("labels or shift_labels are needed")
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    h = hidden.reshape(-1, hidden.shape[-1])
    target = shift_labels.reshape(-1).to(h.device)
    if target.shape[0] != h.shape[0]:
        raise ValueError(f"{target.shape[0]} labels for {h.shape[0]} hidden states")
    total = None
    for a, b in tile_bounds(h.shape[0], tile_tokens=chunk):
        part = checkpoint(_chunk_loss, head, h[a:b], target[a:b], ignore_index, use_reentrant=False)
        total = part if total is None else total + part
    if num_items_in_batch is None:
        return total / (target != ignore_index).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


class LongContext:
    """What :func:`long_context` did to a model; :meth:`undo` undoes it (also on leaving ``with``)."""

    def __init__(self, model: nn.Module, lm: nn.Module) -> None:
        self.model = model
        """The model given (a PeftModel, or the causal LM itself)."""
        self.causal_lm = lm
        """The ``*ForCausalLM`` module whose layers and forward were changed."""
        self.tiled_mlps = 0
        """How many MLPs are tiled (``tile="mlp"``)."""
        self.tiled_layers = 0
        """How many decoder layers are tiled whole but for attention (``tile="layer"``)."""
        self.checkpointing_enabled = False
        """Whether this call turned activation checkpointing on (it is turned off by undo)."""
        self.chunked_loss = False
        """Whether the forward computes the loss in chunks."""
        self._undo: list[Any] = []

    def undo(self) -> None:
        """Restores the model as it was (idempotent), the input embeddings' hooks included: those
        that turning checkpointing on brought, PEFT's among them (Note [undo leaves the embeddings'
        hooks as they were])."""
        while self._undo:
            self._undo.pop()()
        self.tiled_mlps, self.tiled_layers, self.checkpointing_enabled, self.chunked_loss = 0, 0, False, False
        self.causal_lm.__dict__.pop(_MARK, None)

    def __enter__(self) -> LongContext:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.undo()

    def __repr__(self) -> str:
        return (f"LongContext({type(self.causal_lm).__name__}: tiled_mlps={self.tiled_mlps}, "
                f"tiled_layers={self.tiled_layers}, "
                f"checkpointing_enabled={self.checkpointing_enabled}, chunked_loss={self.chunked_loss})")


def long_context(model: nn.Module, *, tile_tokens: int | None = None, loss_chunk: int = 4096,
                 checkpointing: bool = True, offloader: Any = None, tile: str = "mlp",
                 head_groups: int | None = None, layer_memory: int | None = None) -> LongContext:
    """Sets a Llama / Mistral / Qwen2 / Qwen3 causal LM up for long sequences (module docstring).

    Args:
        model: a ``transformers`` ``*ForCausalLM`` of those families, or a PEFT model around one.
        tile_tokens: sequence positions per tile; ``None``: the hidden size; ``0``: nothing tiled.
        tile: ``"mlp"``: each layer's MLP tiled; ``"layer"``: each layer tiled whole but for
            attention (the norms, q/k/v with RoPE, the o-projection, residuals and the MLP:
            :mod:`ssdtrain.longctx.hf_layer`); ``"heads"``: that, and attention a group of query
            heads at a time (:mod:`ssdtrain.longctx.head_groups`): the least memory.
        head_groups: ``tile="heads"``: how many groups (dividing the query heads, and a divisor or a
            multiple of the key/value heads; ``None``: one per key/value head).
        layer_memory: ``tile="heads"``: the bytes a recomputed layer may hold. At each sequence
            length a layer then takes the fewest groups and the longest tiles that fit it, as the
            planner models the layer (:mod:`ssdtrain.longctx.sizing`), and ``head_groups`` groups of
            ``tile_tokens`` positions where nothing coarser does: a sequence whose layer fits whole
            is not cut up. ``None``: always ``head_groups`` and ``tile_tokens``.
        loss_chunk: tokens per chunk of the loss; ``0``: the model's own loss.
        checkpointing: turn per-layer activation checkpointing on (non-reentrant) if it is off.
        offloader: an :class:`ssdtrain.Offloader` (or ``ssdtrain.offload(...)``'s result) that
            every training forward of ``model`` then runs inside, as with ``with off:``; ``None``:
            your own ``with off:`` or the Trainer callback does it.

    Returns:
        A :class:`LongContext`; its ``undo()`` restores the model.

    Raises:
        ValueError: another model family, or the model already switched.
    """
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    _check(lm)
    if tile_tokens is not None and tile_tokens != 0:
        tile_bounds(1, tile_tokens=tile_tokens)  # checks it
    if tile not in ("mlp", "layer", "heads"):
        raise ValueError(f"tile must be 'mlp' (each layer's MLP in tiles), 'layer' (the whole layer but "
                         f"attention) or 'heads' (that, and attention a group of heads at a time), got {tile!r}")
    if tile != "mlp" and tile_tokens == 0:
        raise ValueError(f"tile={tile!r} with tile_tokens=0 tiles nothing: give tile_tokens (None: the hidden size)")
    if head_groups is not None and tile != "heads":
        raise ValueError(f"head_groups is for tile='heads', not tile={tile!r}")
    if layer_memory is not None and (tile != "heads" or isinstance(layer_memory, bool)
                                     or not isinstance(layer_memory, int) or layer_memory < 1):
        raise ValueError(f"layer_memory is a positive int of bytes for tile='heads', got {layer_memory!r} "
                         f"with tile={tile!r}")
    if (tile != "mlp" or tile_tokens != 0) and partitioned(lm.parameters()):
        raise ValueError("long_context: the model's parameters are DeepSpeed ZeRO-3 partitions; tiles under ZeRO-3 are "
                         "not supported yet: use ZeRO stage 1 or 2, or tile_tokens=0 for checkpointing and the chunked "
                         "loss without tiles")
    groups = lm.config.num_key_value_heads if head_groups is None else head_groups
    if tile == "heads":
        from ssdtrain.longctx.hf_layer import check_head_groups

        check_head_groups(lm.config, groups)
    if isinstance(loss_chunk, bool) or not isinstance(loss_chunk, int) or loss_chunk < 0:
        raise ValueError(f"loss_chunk must be an int >= 0 (0: the model's own loss), got {loss_chunk!r}")
    done = LongContext(model, lm)
    try:
        if checkpointing:
            _enable_checkpointing(lm, done)
        if tile in ("layer", "heads"):
            from ssdtrain.longctx.hf_layer import tile_layer_in_place

            for layer in lm.model.layers:
                done._undo.append(tile_layer_in_place(layer, tile_tokens, groups if tile == "heads" else None,
                                                      layer_memory))
                done.tiled_layers += 1
        elif tile_tokens != 0:
            for layer in lm.model.layers:
                done._undo.append(tile_in_place(layer.mlp, tile_tokens=tile_tokens))
                done.tiled_mlps += 1
        if loss_chunk:
            done._undo.append(_chunk_the_loss(lm, loss_chunk))
            done.chunked_loss = True
        if offloader is not None:
            from ssdtrain.integrations.transformers import _ForwardOffload

            hooks = _ForwardOffload(model, offloader)
            done._undo.append(hooks.remove)
    except BaseException:
        done.undo()
        raise
    setattr(lm, _MARK, done)
    return done


def _check(lm: nn.Module) -> None:
    config = getattr(lm, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"long_context supports the causal LMs of {', '.join(SUPPORTED_MODEL_TYPES)} (config.model_type), "
            f"not {type(lm).__name__} ({kind!r}): its forward may change the logits after the head, or its "
            "MLP may not be position-wise")
    if not (isinstance(getattr(lm, "lm_head", None), nn.Module) and hasattr(getattr(lm, "model", None), "layers")):
        raise ValueError(f"{type(lm).__name__} has no lm_head and model.layers: not a *ForCausalLM")
    if lm.__dict__.get(_MARK) is not None:
        raise ValueError(f"{type(lm).__name__} is already switched by long_context; undo() it first")
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:  # older transformers: no loss registry to differ from
        return
    if getattr(lm, "loss_function", ForCausalLMLoss) is not ForCausalLMLoss:
        raise ValueError("the model's loss_function is not ForCausalLMLoss, the loss long_context computes")


def _checkpointing_on(lm: nn.Module) -> bool:
    return any(getattr(m, "gradient_checkpointing", False) for m in lm.modules())


def _enable_checkpointing(lm: nn.Module, done: LongContext) -> None:
    if _checkpointing_on(lm):
        return
    # Note [undo leaves the embeddings' hooks as they were]: turning checkpointing on makes
    # transformers hook the input embeddings so that their output requires grad
    # (``enable_input_require_grads``), and PEFT's ``get_peft_model`` on a model with checkpointing
    # on hooks them again (``PeftModel._prepare_model_for_gradient_checkpointing``; without it, a
    # LoRA model has no such hook), while transformers keeps the handles of the latest call only.
    # So undo removes every such hook that came while the switch held checkpointing on (the
    # checkpointing caused them: PEFT adds none to a model without it), keeps every other hook and
    # those there before, and restores transformers' record of its handles.
    before = {m: set(m._forward_hooks) for m in lm.modules()}
    record = {name: lm.__dict__[name] for name in _REQUIRE_GRADS_RECORD if name in lm.__dict__}
    if hasattr(lm, "activation_checkpointing_enable"):  # transformers 5
        lm.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        disable = lm.activation_checkpointing_disable
    else:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        disable = lm.gradient_checkpointing_disable
    done.checkpointing_enabled = True

    def undo() -> None:
        disable()
        for module, kept in before.items():
            for key, hook in list(module._forward_hooks.items()):
                if key not in kept and getattr(hook, "__name__", "").startswith(_REQUIRE_GRADS_HOOK):
                    for table in ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called"):
                        getattr(module, table, {}).pop(key, None)  # what RemovableHandle.remove() does
        for name in _REQUIRE_GRADS_RECORD:
            if name in record:
                lm.__dict__[name] = record[name]
            else:
                lm.__dict__.pop(name, None)

    done._undo.append(undo)


def _chunk_the_loss(lm: nn.Module, chunk: int) -> Any:
    """Replaces ``lm.forward`` (an instance attribute) with one computing the loss in chunks."""
    original = lm.forward
    sig = inspect.signature(original)
    var_kw = next((p.name for p in sig.parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    to_base = [name for name, p in sig.parameters.items()
               if p.kind is not inspect.Parameter.VAR_KEYWORD and name not in ("labels", "logits_to_keep")]

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if not (lm.training and torch.is_grad_enabled()):
            return original(*args, **kwargs)
        return_dict = kwargs.get("return_dict")
        try:
            bound = sig.bind(*args, **{k: v for k, v in kwargs.items() if k != "return_dict"})
        except TypeError:
            return original(*args, **kwargs)  # let the model's forward say what is wrong
        given = bound.arguments
        keep = given.get("logits_to_keep", 0)
        if given.get("labels") is None or not (isinstance(keep, int) and keep == 0):
            return original(*args, **kwargs)
        extra = dict(given.get(var_kw, {})) if var_kw else {}
        out = lm.model(**{name: given[name] for name in to_base if name in given}, **extra)
        loss = chunked_lm_loss(lm.lm_head, out.last_hidden_state, given["labels"], chunk=chunk,
                               num_items_in_batch=extra.get("num_items_in_batch"),
                               ignore_index=extra.get("ignore_index", -100),
                               shift_labels=extra.get("shift_labels"))
        from transformers.modeling_outputs import CausalLMOutputWithPast

        cache = _cache_field(CausalLMOutputWithPast)
        result = CausalLMOutputWithPast(loss=loss, logits=None, **{cache: getattr(out, cache, None)},
                                        hidden_states=out.hidden_states, attentions=out.attentions)
        if return_dict is None:
            return_dict = getattr(lm.config, "return_dict", True)
        return result if return_dict is not False else result.to_tuple()

    return replace_forward(lm, forward)


def _cache_field(output_cls: type) -> str:
    """The name of a model output's key/value cache: ``cache`` since transformers 5.24, where the
    old ``past_key_values`` (given to an output or read from one) still works but logs that it is
    deprecated; ``past_key_values`` before."""
    return "cache" if "cache" in {f.name for f in dataclasses.fields(output_cls)} else "past_key_values"
