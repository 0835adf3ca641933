"""A whole Llama layer in sequence tiles (``ssdtrain.longctx.tiled_layer``, the bench's
``tile_layers``): against the plain model, per parameter class; with an offloader, equal to itself
without one; and ``tiled_parts`` on several inputs and outputs."""

import copy

import pytest
import torch

import ssdtrain
from ssdtrain.bench.models import Llama, LlamaConfig
from ssdtrain.bench.tiled_models import tile_layers, tile_mlps
from ssdtrain.longctx.tiled import tile_bounds
from ssdtrain.longctx.tiled_layer import params_of, tiled_parts

# A parameter's gradient is a sum over tokens that tiling splits into one partial sum per tile
# (ssdtrain.longctx.tiled's module docstring): equal up to the order of the additions.
WEIGHT_REL = 5e-6
CLASSES = {"norm": ("ln1", "ln2", "ln_f"), "attention": (".attn.",), "mlp": (".mlp.",), "embedding": ("tok_emb",),
           "head": ("head",)}


def _model(seed: int = 0, recompute: bool = True) -> Llama:
    torch.manual_seed(seed)
    return Llama(LlamaConfig(vocab=256, seq=384, layers=3, hidden=64, heads=4, loss_chunk=128), recompute=recompute)


def _step(model, tokens, off=None):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)
    if off is None:
        loss = model(tokens, tokens)
    else:
        with off:
            loss = model(tokens, tokens)
            off.wait()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _class(name: str) -> str:
    return next(c for c, keys in CLASSES.items() if any(k in name for k in keys))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("tile_tokens", [64, 96, 1000])
def test_tiled_layers_against_the_plain_model(tile_tokens):
    """Per parameter class, the largest relative difference of a gradient against the untiled
    model: the loss is equal, and so are the head's and the final norm's gradients (after the
    layers); every other within the tiles' order of additions. One tile: all equal."""
    tokens = torch.randint(0, 256, (2, 384), generator=torch.Generator().manual_seed(3))
    plain = _model()
    tiled = copy.deepcopy(plain)
    assert tile_layers(tiled, tile_tokens) == 3
    loss0, g0 = _step(plain, tokens)
    loss, g = _step(tiled, tokens)
    assert torch.equal(loss, loss0)
    worst: dict[str, float] = {}
    for name in g0:
        worst[_class(name)] = max(worst.get(_class(name), 0.0), _rel(g[name], g0[name]))
    if tile_tokens >= 384:
        assert all(v == 0.0 for v in worst.values()), worst
    assert worst["head"] == 0.0 and all(v < WEIGHT_REL for v in worst.values()), worst


def test_tiled_layers_with_an_offloader_equal_themselves_without(tmp_path):
    """Every save written and read back (min_bytes=0): loss and every gradient ``torch.equal`` to
    the same tiled model without an offloader; nothing left on the drive."""
    tokens = torch.randint(0, 256, (2, 384), generator=torch.Generator().manual_seed(4))
    model = _model()
    tile_layers(model, 64)
    want = _step(model, tokens)
    off = ssdtrain.Offloader(model, path=str(tmp_path), min_bytes=0, late_writes=True)
    try:
        got = _step(model, tokens, off)
        s = off.stats()
    finally:
        off.close()
    assert torch.equal(got[0], want[0]) and all(torch.equal(got[1][n], want[1][n]) for n in want[1])
    assert s.written_bytes > 0 and s.read_bytes > 0
    assert list(tmp_path.iterdir()) == []


def test_tile_layers_refuses_a_gpt_and_nests_a_tiled_mlp():
    from ssdtrain.bench.models import GPT, GPTConfig

    with pytest.raises(ValueError, match="Llama blocks"):
        tile_layers(GPT(GPTConfig(vocab=64, seq=32, layers=1, hidden=32, heads=2)))
    tokens = torch.randint(0, 256, (1, 384), generator=torch.Generator().manual_seed(5))
    a = _model()
    b = copy.deepcopy(a)
    tile_layers(a, 64)
    tile_mlps(b, 64)
    tile_layers(b, 64)  # the MLP already tiled: a tile of the layer is one tile of the MLP
    la, ga = _step(a, tokens)
    lb, gb = _step(b, tokens)
    assert torch.equal(la, lb) and all(torch.equal(ga[n], gb[n]) for n in ga)


def test_tiled_parts_several_inputs_and_outputs_gradcheck():
    """Two inputs (one with the sequence at -2 of a 4-D tensor), two outputs, a parameter:
    gradients by finite differences in float64."""
    torch.manual_seed(0)
    w = torch.randn(6, 6, dtype=torch.float64, requires_grad=True)
    x = torch.randn(2, 10, 6, dtype=torch.float64, requires_grad=True)
    y = torch.randn(2, 3, 10, 2, dtype=torch.float64, requires_grad=True)
    bounds = tile_bounds(10, tile_tokens=3)

    def part(a, b, xt, yt):
        u = torch.tanh(xt @ w) * (a + 1)  # the tile's position reaches the part
        return u, yt.transpose(1, 2).reshape(2, b - a, 6).sin() + u

    def f(x, y, w_):
        return tiled_parts(part, (x, y), (w_,), bounds)

    assert torch.autograd.gradcheck(f, (x, y, w))
    whole = [part(a, b, x[:, a:b], y[:, :, a:b]) for a, b in bounds]
    got = f(x, y, w)
    assert torch.equal(got[0], torch.cat([t[0] for t in whole], 1))
    assert params_of(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2, bias=False)).__len__() == 3
