"""Attention a group of query heads at a time, in a layer tiled whole (``ssdtrain.longctx.head_groups``):
the bench's Llama (``tile_layers(..., head_groups=G)``) and Hugging Face's (``long_context(tile="heads")``)
against the plain model per parameter class, with an offloader equal to themselves without one, both
ways of taking attention's gradients (the CPU kernel's backward, and attention run again), what the
layer keeps for backward, gradcheck, and the refusals."""

from __future__ import annotations

import copy

import pytest
import torch

import ssdtrain
import ssdtrain.longctx.head_groups as HG
from ssdtrain.bench.models import Llama, LlamaConfig
from ssdtrain.bench.tiled_models import tile_layers, tile_mlps
from ssdtrain.longctx.head_groups import grouped_layer
from ssdtrain.longctx.tiled import tile_bounds
from tests.test_tiled_layer import _step

WEIGHT_REL = 5e-6  # sums over tiles and over groups, in another order than one call's (test_tiled_layer's)
CLASSES = {"norm": ("ln1", "ln2", "ln_f"), "attention": (".attn.",), "mlp": (".mlp.",), "embedding": ("tok_emb",),
           "head": ("head",)}


def _model(kv: int = 1, seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    return Llama(LlamaConfig(vocab=256, seq=384, layers=3, hidden=64, heads=4, kv_heads=kv, loss_chunk=128),
                 recompute=True)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _worst(got: dict, want: dict) -> dict[str, float]:
    worst: dict[str, float] = {}
    for name, g in got.items():
        part = next(c for c, keys in CLASSES.items() if any(k in name for k in keys))
        worst[part] = max(worst.get(part, 0.0), _rel(g, want[name]))
    return worst


def same_with_offloader(step, model, path, loss, grads) -> None:
    """``step(model, off)`` under an offloader that writes every save gives ``loss`` (unless ``None``)
    and ``grads``, equal (``torch.equal``)."""
    off = ssdtrain.Offloader(model, path=str(path), min_bytes=0, late_writes=True)
    try:
        got_loss, got = step(model, off)
        assert off.stats().written_bytes > 0
    finally:
        off.close()
    assert (loss is None or torch.equal(got_loss, loss)) and all(torch.equal(got[n], grads[n]) for n in grads)


@pytest.fixture
def no_kernel(monkeypatch):
    """The recompute path wherever it would take the kernel's."""
    monkeypatch.setattr(HG, "kernel_available", lambda device: False)


@pytest.mark.parametrize("path", ["kernel", "recompute"])
@pytest.mark.parametrize("kv,groups", [(1, 4), (1, 2), (2, 2), (2, 4), (4, 1)])
def test_bench_llama_head_groups(request, tmp_path, path, kv, groups):
    """Every parameter class within WEIGHT_REL of the plain model's gradient (the loss too), and with
    an offloader that writes every save, equal to itself without one."""
    if path == "recompute":
        request.getfixturevalue("no_kernel")
    tokens = torch.randint(0, 256, (2, 384), generator=torch.Generator().manual_seed(3))
    plain_loss, plain = _step(_model(kv), tokens)
    model = _model(kv)
    assert tile_layers(model, 100, head_groups=groups) == 3
    loss, grads = _step(model, tokens)
    assert _rel(loss, plain_loss) < 1e-6
    worst = _worst(grads, plain)
    assert set(worst) == set(CLASSES) and all(v < WEIGHT_REL for v in worst.values()), worst
    same_with_offloader(lambda m, off: _step(m, tokens, off), model, tmp_path, loss, grads)


@pytest.mark.parametrize("path", ["kernel", "recompute"])
def test_autocast_bf16(request, tmp_path, path):
    """Under CPU autocast to bfloat16 (RoPE's float32 tables promote q and k, v stays bfloat16):
    attention runs in bfloat16 as SDPA's autocast would have it, every gradient within bfloat16's
    reach of the plain model's (2e-2 of the largest entry; the layer tiled with attention whole is
    as far), and with an offloader equal to itself without one."""
    if path == "recompute":
        request.getfixturevalue("no_kernel")
    tokens = torch.randint(0, 256, (2, 384), generator=torch.Generator().manual_seed(5))

    def step(model, off=None):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return _step(model, tokens, off)

    _, plain = step(_model(2))
    model = _model(2)
    tile_layers(model, 100, head_groups=4)
    _, grads = step(model)
    assert all(_rel(grads[n], plain[n]) < 2e-2 for n in plain)
    same_with_offloader(step, model, tmp_path, None, grads)


def test_the_layer_keeps_its_input_attentions_output_and_log_sum_exp():
    """What a grouped layer saves for backward, counted by a saved-tensor hook: of the whole
    sequence its input, attention's output and the fp32 log-sum-exp (kernel path); attention's
    output alone less (recompute path). The layer tiled with attention whole saves q, k and v too."""
    cfg = LlamaConfig(vocab=256, seq=256, layers=1, hidden=64, heads=4, loss_chunk=0)
    x = torch.randn(1, 256, 64, requires_grad=True)
    saved = []

    def count(groups):
        torch.manual_seed(0)
        model = Llama(cfg)
        tile_layers(model, 64, head_groups=groups)
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t,
                                                      lambda t: t):
            model.blocks[0](x)
        return sum(saved)

    s, h, heads = 256, 64, 4
    assert count(4) == 4 * s * h * 2 + 4 * s * heads  # x, y (fp32), lse
    whole = count(None)
    assert whole >= 4 * s * (h + h + 16 + 16 + h)  # x, q, k, v, y: at least


@pytest.mark.parametrize("attend", [False, True])
def test_grouped_layer_gradcheck(attend):
    """``grouped_layer`` on a small double-precision layer: gradcheck against finite differences,
    both paths (kernel: the CPU flash kernel's backward; attend: SDPA run again)."""
    torch.manual_seed(0)
    b, s, h, heads, kv, d = 1, 12, 8, 4, 2, 2
    wq, wk, wv = (torch.randn(n * d, h, dtype=torch.double, requires_grad=True) for n in (heads, kv, kv))
    wo = torch.randn(h, heads * d, dtype=torch.double, requires_grad=True)
    groups, hq, hk = 2, heads // 2, kv // 2

    def part(lo, hi, g, xt):
        t = hi - lo
        q = torch.nn.functional.linear(xt, wq[g * hq * d:(g + 1) * hq * d]).view(b, t, hq, d).transpose(1, 2)
        k = torch.nn.functional.linear(xt, wk[g * hk * d:(g + 1) * hk * d]).view(b, t, hk, d).transpose(1, 2)
        v = torch.nn.functional.linear(xt, wv[g * hk * d:(g + 1) * hk * d]).view(b, t, hk, d).transpose(1, 2)
        return q, k.tanh(), v

    def post(lo, hi, xt, yt):
        return (xt + torch.nn.functional.linear(yt.transpose(1, 2).reshape(b, hi - lo, -1), wo).sin(),)

    def sdpa(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    bounds = tile_bounds(s, tile_tokens=5)

    def f(x, *ws):
        return grouped_layer(part, post, (x,), (wq, wk, wv), (wo,), bounds, groups, kv,
                             attend=sdpa if attend else None)

    x = torch.randn(b, s, h, dtype=torch.double, requires_grad=True)
    assert torch.autograd.gradcheck(f, (x, wq, wk, wv, wo))


def test_attention_dropout_draws_the_same_masks_in_backward():
    """The recompute path with dropout in attention (``random=True``): the forward runs attention a
    group at a time and backward replays the RNG, so the gradients are those of plain autograd
    over the same computation drawing the same masks (a mismatch would be off by far more than
    1e-9), and dropout did act (the output differs from the one without it)."""
    torch.manual_seed(0)
    b, s, h, heads, kv, d, groups = 1, 16, 8, 4, 2, 2, 4
    wq, wk, wv = (torch.randn(n * d, h, dtype=torch.double, requires_grad=True) for n in (heads, kv, kv))
    hq, rep = heads // groups, heads // kv

    def part(lo, hi, g, xt):
        t, k0 = hi - lo, g * hq // rep
        q = torch.nn.functional.linear(xt, wq[g * hq * d:(g + 1) * hq * d]).view(b, t, hq, d).transpose(1, 2)
        k = torch.nn.functional.linear(xt, wk[k0 * d:(k0 + 1) * d]).view(b, t, 1, d).transpose(1, 2)
        v = torch.nn.functional.linear(xt, wv[k0 * d:(k0 + 1) * d]).view(b, t, 1, d).transpose(1, 2)
        return q, k, v

    def post(lo, hi, xt, yt):
        return (xt + yt.transpose(1, 2).reshape(b, hi - lo, -1).tanh(),)

    def attend(q, k, v, p=0.5):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, enable_gqa=True)

    x = torch.randn(b, s, h, dtype=torch.double, requires_grad=True)
    bounds = tile_bounds(s, tile_tokens=5)
    torch.manual_seed(3)
    z = grouped_layer(part, post, (x,), (wq, wk, wv), (), bounds, groups, kv, attend=attend, random=True)
    got = torch.autograd.grad(z.square().sum(), (x, wq, wk, wv))
    torch.manual_seed(3)
    ys = [attend(*part(0, s, g, x)) for g in range(groups)]
    ref = post(0, s, x, torch.cat(ys, 1))[0]
    want = torch.autograd.grad(ref.square().sum(), (x, wq, wk, wv))
    assert torch.allclose(z, ref, rtol=0, atol=1e-12)
    assert all(torch.allclose(a, c, rtol=0, atol=1e-9) for a, c in zip(got, want))
    quiet = post(0, s, x, torch.cat([attend(*part(0, s, g, x), p=0.0) for g in range(groups)], 1))[0]
    assert not torch.allclose(quiet, ref)


def test_refusals():
    model = _model(1)
    with pytest.raises(ValueError, match="head_groups must divide the 4 query heads"):
        tile_layers(model, 64, head_groups=3)
    x = torch.randn(1, 8, 4)
    with pytest.raises(ValueError, match="groups must be a positive int"):
        grouped_layer(lambda *a: a, lambda *a: a, (x,), (), (), ((0, 8),), 0, 1, attend=lambda q, k, v: q)
    if not HG.kernel_available(torch.device("meta")):
        with pytest.raises(ValueError, match="no fused attention kernel"):
            grouped_layer(lambda *a: a, lambda *a: a, (x.to("meta"),), (), (), ((0, 8),), 1, 1)


transformers = pytest.importorskip("transformers")
from ssdtrain.longctx.hf import long_context  # noqa: E402
from tests.test_longctx_hf import _step as hf_step  # noqa: E402

HF = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
      "mistral": ("MistralConfig", "MistralForCausalLM")}
SEQ, VOCAB, TILE, CHUNK = 128, 512, 40, 100


def _hf(kind: str, impl: str = "sdpa") -> torch.nn.Module:
    config_cls, model_cls = (getattr(transformers, n) for n in HF[kind])
    config = config_cls(hidden_size=64, intermediate_size=224, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=SEQ,
                        use_cache=False, attention_dropout=0.0, attn_implementation=impl)
    torch.manual_seed(0)
    return model_cls(config).train()


def _hf_step(model, off=None):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    labels = ids.clone()
    labels[:, :10] = -100
    out, grads = hf_step(model, (ids, labels), off)
    return out.loss.detach(), grads


@pytest.mark.parametrize("kind,impl,groups", [("llama", "sdpa", None), ("llama", "eager", 2), ("qwen3", "sdpa", 1),
                                              ("mistral", "sdpa", 4), ("llama", "eager", 4),
                                              ("qwen3", "eager", 4)])
def test_hf_tile_heads(tmp_path, kind, impl, groups):
    """``long_context(tile="heads")``: per parameter class within 2e-6 of the plain model; with an
    offloader equal to itself without one; undone, the plain model bit for bit. ``eager``: the
    model's own attention function run again for each group (the recompute path)."""
    plain_loss, plain = _hf_step(_hf(kind, impl))
    model = _hf(kind, impl)
    lc = long_context(model, tile_tokens=TILE, loss_chunk=CHUNK, tile="heads", head_groups=groups)
    assert lc.tiled_layers == 2
    loss, grads = _hf_step(model)
    assert _rel(loss, plain_loss) < 1e-6
    worst: dict[str, float] = {}
    for name, g in grads.items():
        part = ("norm" if "norm" in name else "attention" if ".self_attn." in name else "mlp" if ".mlp." in name
                else name.split(".")[-2])
        worst[part] = max(worst.get(part, 0.0), _rel(g, plain[name]))
    assert all(v < 2e-6 for v in worst.values()), worst
    same_with_offloader(_hf_step, model, tmp_path, loss, grads)
    lc.undo()
    undone_loss, undone = _hf_step(model)
    assert torch.equal(undone_loss, plain_loss) and all(torch.equal(undone[n], plain[n]) for n in plain)


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # peft 0.21's
def test_hf_tile_heads_with_lora_and_refusals():
    """PEFT's LoRA on q/k/v/o with attention a group of heads at a time (its projections compute every
    row, the group's are kept): the adapters' gradients close to the plain LoRA model's."""
    peft = pytest.importorskip("peft")
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], lora_dropout=0.0)
    plain = peft.get_peft_model(_hf("llama"), cfg)
    torch.manual_seed(5)
    for p in plain.parameters():
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.02)
    model = peft.get_peft_model(_hf("llama"), copy.deepcopy(cfg))
    model.load_state_dict(plain.state_dict())
    _, want = _hf_step(plain)
    lc = long_context(model, tile_tokens=TILE, loss_chunk=CHUNK, tile="heads")
    _, got = _hf_step(model)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all(_rel(got[n], want[n]) < 2e-6 for n in trained)
    lc.undo()
    with pytest.raises(ValueError, match="dividing the model's 4 query heads"):
        long_context(_hf("llama"), tile="heads", head_groups=3)
    with pytest.raises(ValueError, match="head_groups is for tile='heads'"):
        long_context(_hf("llama"), tile="layer", head_groups=2)


def test_hf_heads_runs_the_projections_hooks():
    """tile="heads" with a forward pre-hook on q/k/v (DeepSpeed ZeRO-3 gathers a sharded weight in
    one, a profiler counts calls): the hook runs (the projection computes every row and the group's
    are kept) and the gradients stay those of the model without hooks, to rounding."""
    want_loss, want = _hf_step(long_context(_hf("llama"), tile_tokens=16, loss_chunk=CHUNK, tile="heads").model)
    model = long_context(_hf("llama"), tile_tokens=16, loss_chunk=CHUNK, tile="heads").model
    calls = []
    for layer in model.model.layers:
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            proj.register_forward_pre_hook(lambda module, args: calls.append(module))
    loss, grads = _hf_step(model)
    # per layer and projection: the forward, the recomputation, made again and replayed, each a group
    assert len(calls) >= 2 * 3 * 4 * 2
    assert _rel(loss, want_loss) < 1e-6 and all(_rel(grads[n], want[n]) < 2e-6 for n in want)


def test_tiles_refuse_zero3_partitions():
    """Parameters DeepSpeed ZeRO-3 partitions (a ``ds_id``; outside their module's forward an empty
    placeholder) make a tiled Function's gradient fail deep in backward (DeepSpeed 0.19.8: "expected
    shape compatible with [0]"): long_context refuses them at once, a tiled layer at its forward, both
    naming the way out; without tiles (tile_tokens=0) long_context takes them."""
    marked = _hf("llama")
    marked.model.layers[0].mlp.up_proj.weight.ds_id = 0
    with pytest.raises(ValueError, match="ZeRO-3 partitions; tiles under ZeRO-3 are not supported yet"):
        long_context(marked, tile="heads")
    long_context(marked, tile_tokens=0).undo()
    model = long_context(_hf("llama"), tile_tokens=16, loss_chunk=CHUNK, tile="heads").model
    model.model.layers[1].self_attn.q_proj.weight.ds_id = 0  # partitioned after long_context, as by deepspeed.initialize
    with pytest.raises(RuntimeError, match="tiles under DeepSpeed ZeRO-3 .* use ZeRO stage 1 or 2, or "
                                           r"long_context\(model, tile_tokens=0\)"):
        _hf_step(model)
    bench = _model()
    tile_mlps(bench, 100)
    bench.blocks[0].mlp.down.weight.ds_id = 0
    with pytest.raises(RuntimeError, match="tiles under DeepSpeed ZeRO-3"):
        _step(bench, torch.randint(0, 256, (1, 384)))
