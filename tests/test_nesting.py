"""Nested blocks: ``with off:`` inside an open block of the same offloader is part of the outer
one (Note [nested blocks are one]); exact, and nothing left live once the graph is freed."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

import ssdtrain
from ssdtrain.bench.models import GPT, GPTConfig

from _equiv import assert_same, step

CFG = GPTConfig(vocab=256, seq=32, layers=3, hidden=64, heads=4, dropout=0.1)


@pytest.fixture
def gpt():
    torch.manual_seed(0)
    return GPT(CFG)


def _tokens():
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, CFG.vocab, (4, CFG.seq), generator=g), torch.randint(0, CFG.vocab, (4, CFG.seq), generator=g)


def _by_parts(model, tok, tgt, off, inner):
    """The model's forward with ``inner()`` (a context) around its blocks only."""
    x = model.tok_emb(tok) + model.pos_emb(torch.arange(tok.shape[1]))
    with inner():
        for block in model.blocks:
            x = block(x)
    logits = model.head(model.ln_f(x))
    return F.cross_entropy(logits.reshape(-1, CFG.vocab), tgt.reshape(-1))


def _no_hooks() -> bool:
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is None


# The offloaders here write whatever they are given (late_writes=True): nesting is under test, not
# Note [write what leaves before the peak], and wait() in forward must find the writes to land.
def _settled(off, off_dir):
    gc.collect()
    off.wait()
    s = off.stats()
    assert s.live_entries == 0 and s.resident_bytes == 0 and s.live_disk_bytes == 0, s
    assert s.written_bytes > 0 and s.read_bytes > 0
    off.close()
    assert list(off_dir.iterdir()) == []
    return s


def test_nested_around_the_whole_model_and_a_part(gpt, off_dir):
    """``with off:`` in ``with off:`` (the issue's IndexError), around the whole model and around
    its blocks: gradients equal those without offloading, the inner exit leaves the outer open
    (its saves still offloaded, backward starts at the outer exit), no hooks left."""
    tok, tgt = _tokens()
    base = step(gpt, lambda: gpt(tok, tgt), None)
    off = ssdtrain.Offloader(gpt, path=str(off_dir), min_bytes=0, late_writes=True)

    def whole():
        with off:
            return gpt(tok, tgt)

    def part():
        loss = _by_parts(gpt, tok, tgt, off, lambda: off)
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is not None  # the outer's
        return loss

    for wait in (False, True):
        assert_same(base, step(gpt, whole, off, wait=wait))
        assert_same(base, step(gpt, part, off, wait=wait))
        assert _no_hooks()
    _settled(off, off_dir)


def test_three_deep_and_an_error_inside(gpt, off_dir):
    """Three levels; then an error raised inside the inner block passes through both exits and
    leaves no hooks; the next step is exact."""
    tok, tgt = _tokens()
    base = step(gpt, lambda: gpt(tok, tgt), None)
    off = ssdtrain.Offloader(gpt, path=str(off_dir), min_bytes=0, late_writes=True)

    def deep():
        with off, off:
            return gpt(tok, tgt)

    assert_same(base, step(gpt, deep, off, wait=True))
    with pytest.raises(ValueError, match="inside"):
        with off:
            with off:
                gpt(tok, tgt)
                raise ValueError("inside")
    assert _no_hooks()
    assert_same(base, step(gpt, lambda: gpt(tok, tgt), off, wait=True))
    _settled(off, off_dir)


def test_with_off_inside_a_microbatch_and_a_microbatch_inside_with_off(gpt, off_dir):
    """``with off:`` inside ``off.microbatch(i)`` is part of the micro-batch (its saves, its
    prefetch); ``off.microbatch(i)`` inside ``with off:`` keeps its own scope, as a pipeline
    schedule needs (``prefetch(i)`` names it). Accumulated gradients exact either way."""
    tok, tgt = _tokens()
    halves = list(zip(tok.chunk(2), tgt.chunk(2)))

    def run(off, arrangement):
        gpt.zero_grad(set_to_none=True)
        torch.manual_seed(1234)
        losses = []
        for i, (t, y) in enumerate(halves):
            if arrangement == "plain":
                losses.append(gpt(t, y))
                continue
            outer, inner = (off.microbatch(i), off) if arrangement == "with in microbatch" else (off, off.microbatch(i))
            with outer:
                with inner:
                    losses.append(gpt(t, y))
            if arrangement == "with in microbatch":
                off.wait()  # (the micro-batch's writes land: backward reads them back)
        assert _no_hooks()
        for i in reversed(range(len(halves))):
            if off is not None:
                off.prefetch(i)
            losses[i].backward()
        return [p.grad.clone() for p in gpt.parameters()]

    want = run(None, "plain")
    off = ssdtrain.Offloader(gpt, path=str(off_dir), min_bytes=0, late_writes=True)
    for arrangement in ("with in microbatch", "microbatch in with"):
        before = off.stats()
        got = run(off, arrangement)
        assert all(torch.equal(g, w) for g, w in zip(got, want)), arrangement
        after = off.stats()
        # Every save went to a micro-batch's scope: none to a step of the `with off:`.
        to_microbatches = sum(after.microbatches[i]["saved_bytes"] - before.microbatches.get(i, {}).get("saved_bytes", 0)
                              for i in range(len(halves)))
        assert to_microbatches == after.saved_bytes - before.saved_bytes > 0, arrangement
    _settled(off, off_dir)
