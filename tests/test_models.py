"""Tests for ssdtrain/bench/models.py: the bench's GPT-style decoder."""

import pytest
import torch

from ssdtrain.bench.models import GPT, GPTConfig, preset

TINY = GPTConfig(vocab=64, seq=16, layers=2, hidden=32, heads=4)


def _batch(cfg, b=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, cfg.vocab, (b, cfg.seq), generator=g)
    y = torch.randint(0, cfg.vocab, (b, cfg.seq), generator=g)
    return x, y


def test_shapes_loss_and_tied_head():
    torch.manual_seed(0)
    model = GPT(TINY)
    x, y = _batch(TINY)
    assert model(x).shape == (2, TINY.seq, TINY.vocab)
    loss = model(x, y)
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert model.head.weight is model.tok_emb.weight
    assert isinstance(model.blocks, torch.nn.ModuleList) and len(model.blocks) == TINY.layers


def test_flash_and_naive_attention_agree():
    torch.manual_seed(0)
    flash = GPT(TINY)
    naive = GPT(TINY.replace(flash=False))
    naive.load_state_dict(flash.state_dict())
    x, _ = _batch(TINY)
    torch.testing.assert_close(flash(x), naive(x), rtol=1e-4, atol=1e-5)


def test_causal():
    torch.manual_seed(0)
    for flash in (True, False):
        model = GPT(TINY.replace(flash=flash))
        x, _ = _batch(TINY)
        x2 = x.clone()
        x2[:, -1] = (x2[:, -1] + 1) % TINY.vocab
        torch.testing.assert_close(model(x)[:, :-1], model(x2)[:, :-1])


def test_recompute_gives_identical_gradients():
    torch.manual_seed(0)
    model = GPT(TINY)
    x, y = _batch(TINY)
    model(x, y).backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model.recompute = True
    model(x, y).backward()
    for r, p in zip(ref, model.parameters()):
        assert torch.equal(r, p.grad)


def test_config_validation_and_presets():
    with pytest.raises(ValueError, match="heads"):
        GPTConfig(hidden=30, heads=4)
    with pytest.raises(ValueError, match="layers"):
        GPTConfig(layers=0)
    with pytest.raises(ValueError, match="preset"):
        preset("huge")
    assert preset("default").layers >= 8
    assert preset("quick").replace(layers=3, hidden=None).layers == 3


def test_too_long_sequence_is_an_error():
    model = GPT(TINY)
    with pytest.raises(ValueError, match="exceeds"):
        model(torch.zeros(1, TINY.seq + 1, dtype=torch.long))
