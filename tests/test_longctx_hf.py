"""ssdtrain.longctx.hf.long_context on small random Llama, Qwen2 and Mistral models (float32).

Three models from the same weights: the plain model; the switched one (checkpointing per layer,
tiled MLPs, the loss in chunks); the switched one under an offloader that writes and reads back
every save. Switched + offloaded equals switched (``torch.equal``: loss and every gradient).
Switched against plain: every gradient is equal except the MLP weights' and the LM head's, sums
over tokens that the tiles and chunks split (within ``WEIGHT_REL`` of the largest entry; measured
under 5e-7); the loss is a sum in another order (within ``LOSS_REL``; measured at most 1 ulp).
"""

from __future__ import annotations

import functools

import pytest
import torch

import ssdtrain

transformers = pytest.importorskip("transformers")
from ssdtrain.longctx.hf import chunked_lm_loss, long_context  # noqa: E402

SEQ, BATCH, VOCAB = 128, 2, 512
TILE, CHUNK = 40, 100  # 4 tiles (the last of 8 positions), 3 loss chunks (the last of 56 tokens)
WEIGHT_REL = 2e-6
LOSS_REL = 1e-6

FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
}


def _model(kind: str) -> torch.nn.Module:
    config_cls, model_cls = (getattr(transformers, n) for n in FAMILIES[kind])
    config = config_cls(hidden_size=64, intermediate_size=224, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=SEQ, use_cache=False,
                        attention_dropout=0.0)
    torch.manual_seed(0)
    return model_cls(config).train()


@pytest.fixture(scope="module")
def batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = ids.clone()
    labels[:, :10] = -100  # a prompt the loss ignores
    return ids, labels


def _step(model, batch, off=None):
    ids, labels = batch
    model.zero_grad(set_to_none=True)
    if off is None:
        out = model(input_ids=ids, labels=labels)
    else:
        with off:
            out = model(input_ids=ids, labels=labels)
            off.wait()  # every write lands before backward: backward reads every save back
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@functools.lru_cache(maxsize=None)
def _runs(kind: str, batch) -> tuple:
    """The plain model's step and the switched model's (no offloader), once per family."""
    plain_out, plain = _step(_model(kind), batch)
    model = _model(kind)
    lc = long_context(model, tile_tokens=TILE, loss_chunk=CHUNK)
    assert (lc.tiled_mlps, lc.checkpointing_enabled, lc.chunked_loss) == (2, True, True)
    out, grads = _step(model, batch)
    lc.undo()
    return plain_out.loss.detach(), plain, out.loss.detach(), grads, out.logits


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_switched_offloaded_equals_switched_and_is_close_to_plain(tmp_path, batch, kind):
    plain_loss, plain, loss, grads, logits = _runs(kind, batch)
    assert logits is None  # no (tokens, vocab) logits
    assert abs(loss.item() - plain_loss.item()) <= LOSS_REL * abs(plain_loss.item())
    for name, g in grads.items():
        if ".mlp." in name or name == "lm_head.weight":
            assert _rel(g, plain[name]) < WEIGHT_REL, name
        else:
            assert torch.equal(g, plain[name]), name

    model = _model(kind)
    lc = long_context(model, tile_tokens=TILE, loss_chunk=CHUNK)
    off = ssdtrain.Offloader(model, path=str(tmp_path), min_bytes=0, late_writes=True)
    try:
        got_out, got = _step(model, batch, off)
        off.wait()
        s = off.stats()
    finally:
        off.close()
    assert list(tmp_path.iterdir()) == []
    assert s.written_bytes > 0 and s.read_bytes > 0
    assert torch.equal(got_out.loss, loss)
    assert all(torch.equal(got[n], grads[n]) for n in grads)
    # What was saved: the 2 layers' inputs, the final norm's input, normalized input and output
    # (the loss's hidden states), 4 x 64 bytes a token each, and small tensors (rotary cos and
    # sin): 6.1 such; not the logits (4 x VOCAB bytes a token: 8 such).
    token = BATCH * SEQ * 64 * 4
    assert s.saved_bytes < 7 * token < 4 * VOCAB * BATCH * SEQ

    # Undone: the model's own forward and modules again, bit for bit the plain model.
    lc.undo()
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert not model.is_activation_checkpointing
    undone_out, undone = _step(model, batch)
    assert undone_out.logits is not None and torch.equal(undone_out.loss, plain_loss)
    assert all(torch.equal(undone[n], plain[n]) for n in plain)


def test_offloader_argument_and_eval_and_return_dict(tmp_path, batch):
    """``offloader=``: each training forward runs under it by itself (gradients equal to the
    switched model's); evaluation and forwards without labels run the model's own forward
    (logits); ``return_dict=False`` gives a tuple; undo removes the offloader's hooks."""
    ids, labels = batch
    plain_loss, _, loss, grads, _ = _runs("llama", batch)
    model = _model("llama")
    off = ssdtrain.Offloader(model, path=str(tmp_path), min_bytes=0, late_writes=True)
    lc = long_context(model, tile_tokens=TILE, loss_chunk=CHUNK, offloader=off)
    try:
        out, got = _step(model, batch)  # no `with off:` here
        assert off.stats().saved_bytes > 0
        assert torch.equal(out.loss, loss) and all(torch.equal(got[n], grads[n]) for n in grads)
        with pytest.raises(ValueError, match="already switched"):
            long_context(model)
        as_tuple = model(input_ids=ids, labels=labels, return_dict=False)
        assert isinstance(as_tuple, tuple) and len(as_tuple) == 1 and torch.equal(as_tuple[0], out.loss)
        del as_tuple
        with torch.no_grad():
            model.eval()
            ev = model(input_ids=ids, labels=labels)
        assert ev.logits.shape == (BATCH, SEQ, VOCAB)
        assert abs(ev.loss.item() - plain_loss.item()) <= LOSS_REL * abs(plain_loss.item())
    finally:
        lc.undo()
        model.train()
    saved = off.stats().saved_bytes
    _step(model, batch)
    assert off.stats().saved_bytes == saved  # the hooks are gone
    off.close()


def test_chunked_loss_matches_hugging_face_loss(batch):
    """``num_items_in_batch`` (what the Trainer passes) and ``shift_labels``, against
    ``ForCausalLMLoss`` on whole logits."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    ids, labels = batch
    torch.manual_seed(0)
    head = torch.nn.Linear(64, VOCAB, bias=False)
    hidden = torch.randn(BATCH, SEQ, 64)
    n = torch.tensor(300)
    for kwargs in ({}, {"num_items_in_batch": n}, {"shift_labels": labels}):
        want = ForCausalLMLoss(head(hidden), labels, VOCAB, **kwargs)
        got = chunked_lm_loss(head, hidden, labels, chunk=77, **kwargs)
        assert abs(got.item() - want.item()) <= LOSS_REL * abs(want.item())


def test_refuses_other_families():
    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=32)
    with pytest.raises(ValueError, match="supports the causal LMs"):
        long_context(transformers.GPT2LMHeadModel(config))


def _hooks(module: torch.nn.Module) -> dict:
    return dict(module._forward_hooks)


# peft 0.21 still asks transformers 5 for the deprecated name.
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_undo_leaves_the_embeddings_hooks_as_they_were(batch):
    """Note [undo leaves the embeddings' hooks as they were]: switched, then PEFT (which hooks the
    embeddings again because checkpointing is on), then undone: the embeddings have the hooks of a
    LoRA model never switched (none), so their output no longer requires grad; hooks that were
    there before the switch stay, with transformers' record of them, and so does any other hook."""
    peft = pytest.importorskip("peft")
    ids, _ = batch

    def lora(model):
        torch.manual_seed(3)
        cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        return peft.get_peft_model(model, cfg)

    never = lora(_model("llama"))
    assert _hooks(never.get_input_embeddings()) == {}

    model = _model("llama")  # a plain model: switched and undone
    embed = model.get_input_embeddings()
    long_context(model).undo()
    assert _hooks(embed) == {} and not model.__dict__.get("_require_grads_hooks")

    model = _model("llama")
    embed = model.get_input_embeddings()
    lc = long_context(model)
    peft_model = lora(model)
    assert len(_hooks(embed)) == 2  # transformers' (checkpointing on) and PEFT's
    lc.undo()
    assert _hooks(embed) == _hooks(never.get_input_embeddings()) == {}
    assert not model.__dict__.get("_require_grads_hooks") and "_require_grads_hook" not in model.__dict__
    assert not peft_model.get_input_embeddings()(ids).requires_grad

    model = _model("llama")  # the user's own hooks, before and during the switch
    embed = model.get_input_embeddings()
    model.enable_input_require_grads()
    before, record = _hooks(embed), list(model._require_grads_hooks)
    lc = long_context(model)
    lora(model)
    other = embed.register_forward_hook(lambda module, args, output: None)
    lc.undo()
    assert _hooks(embed) == {**before, other.id: other.hooks_dict_ref()[other.id]}
    assert model._require_grads_hooks == record and model._require_grads_hook is record[0]
    model.disable_input_require_grads()  # transformers' record still removes the user's hook
    other.remove()
    assert _hooks(embed) == {}


def test_the_chunked_loss_names_the_cache_as_transformers_does(batch):
    """transformers 5.24 renamed a model output's ``past_key_values`` to ``cache``: the old name,
    given to an output or read from one, still works but logs that it is deprecated (its logger's
    ``warning_once``, not a Python warning that ``filterwarnings = error`` would catch). The switched
    forward uses the name of the transformers it runs with (``past_key_values`` before 5.24)."""
    import logging

    ids, labels = batch
    model = _model("llama")
    lc = long_context(model, tile_tokens=TILE, loss_chunk=CHUNK)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("transformers")
    once = getattr(logging.Logger, "warning_once", None)
    if hasattr(once, "cache_clear"):
        once.cache_clear()  # a warning logged before this test would not be logged again
    log.addHandler(handler)
    try:
        out = model(input_ids=ids, labels=labels)
    finally:
        log.removeHandler(handler)
        lc.undo()
    assert out.logits is None
    assert not [r.getMessage() for r in records if "deprecated" in r.getMessage()]


LAYER_FAMILIES = dict(FAMILIES, qwen3=("Qwen3Config", "Qwen3ForCausalLM"))


def _layer_model(kind: str) -> torch.nn.Module:
    if kind in FAMILIES:
        return _model(kind)
    config_cls, model_cls = (getattr(transformers, n) for n in LAYER_FAMILIES[kind])
    config = config_cls(hidden_size=64, intermediate_size=224, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=1, head_dim=16, vocab_size=VOCAB, max_position_embeddings=SEQ,
                        use_cache=False, attention_dropout=0.0)
    torch.manual_seed(0)
    return model_cls(config).train()


@pytest.mark.parametrize("kind", list(LAYER_FAMILIES))
def test_tile_layer_whole(tmp_path, batch, kind):
    """``tile="layer"``: every layer tiled whole but for attention. Against the plain model, per
    parameter class: the embedding's gradient and every weight's within WEIGHT_REL (sums over
    tokens split by tiles; the embedding's too now: the first norm is tiled), the loss within
    LOSS_REL; with an offloader, equal to itself without one; undone, the plain model bit for bit."""
    plain_out, plain = _step(_layer_model(kind), batch)
    model = _layer_model(kind)
    lc = long_context(model, tile_tokens=TILE, loss_chunk=CHUNK, tile="layer")
    assert (lc.tiled_layers, lc.tiled_mlps) == (2, 0)
    out, grads = _step(model, batch)
    assert abs(out.loss.item() - plain_out.loss.item()) <= LOSS_REL * abs(plain_out.loss.item())
    worst: dict[str, float] = {}
    for name, g in grads.items():
        part = ("norm" if "norm" in name else "attention" if ".self_attn." in name else "mlp" if ".mlp." in name
                else name.split(".")[-2])
        worst[part] = max(worst.get(part, 0.0), _rel(g, plain[name]))
    assert all(v < WEIGHT_REL for v in worst.values()), worst
    off = ssdtrain.Offloader(model, path=str(tmp_path), min_bytes=0, late_writes=True)
    try:
        got_out, got = _step(model, batch, off)
    finally:
        off.close()
    assert torch.equal(got_out.loss, out.loss) and all(torch.equal(got[n], grads[n]) for n in grads)
    lc.undo()
    assert not any("forward" in m.__dict__ for m in model.modules())
    undone_out, undone = _step(model, batch)
    assert torch.equal(undone_out.loss, plain_out.loss) and all(torch.equal(undone[n], plain[n]) for n in plain)


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # peft 0.21's
def test_tile_layer_with_lora_and_refusals(batch):
    """PEFT's LoRA on q/k/v/o keeps working with the layer tiled (its adapters are inside the
    projections each tile calls): the adapters' gradients close to the plain LoRA model's; names
    unchanged. ``tile`` names a choice; ``tile="layer"`` with nothing to tile is refused."""
    peft = pytest.importorskip("peft")
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], lora_dropout=0.0)
    plain = peft.get_peft_model(_model("llama"), cfg)
    torch.manual_seed(5)
    for p in plain.parameters():  # the adapters (LoRA's B starts at zero): make them do something
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.02)
    model = peft.get_peft_model(_model("llama"), cfg)
    model.load_state_dict(plain.state_dict())
    names = [n for n, _ in model.named_parameters()]

    def adapters(m):
        ids, labels = batch
        m.zero_grad(set_to_none=True)
        m(input_ids=ids, labels=labels).loss.backward()
        return {n: p.grad.clone() for n, p in m.named_parameters() if p.requires_grad}

    want = adapters(plain)
    lc = long_context(model, tile_tokens=TILE, loss_chunk=CHUNK, tile="layer")
    got = adapters(model)
    assert [n for n, _ in model.named_parameters()] == names
    assert want.keys() == got.keys() and len(want) > 0
    assert all(_rel(got[n], want[n]) < WEIGHT_REL for n in want)
    lc.undo()
    with pytest.raises(ValueError, match="tile must be"):
        long_context(_model("llama"), tile="attention")
    with pytest.raises(ValueError, match="tiles nothing"):
        long_context(_model("llama"), tile="layer", tile_tokens=0)
