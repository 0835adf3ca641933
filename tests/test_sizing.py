"""Tiles and head groups sized to the memory a recomputed layer may hold (ssdtrain.longctx.sizing):
the choice against the planner's model of the layer, and the layer sized so gives the gradients of
the same layer tiled so by hand, with and without an offloader (the bench Llama and Hugging Face's)."""

from __future__ import annotations

import json
import types

import pytest
import torch

from ssdtrain.bench.command import main as bench_main
from ssdtrain.bench.tiled_models import block_sizes, tile_layers
from ssdtrain.longctx.sizing import group_choices, sized_heads
from ssdtrain.planner.plan_layer import block_working_bytes, layer_heads_moments
from tests.test_head_groups import _hf, _hf_step, _model, same_with_offloader
from tests.test_tiled_layer import _step

SHAPE = dict(hidden=64, heads=4, kv_heads=1, ffn_hidden=224, dtype_bytes=4)  # the bench's CPU Llama


def _peak(seq: int, tile: int, groups: int, shape: dict = SHAPE) -> int:
    inp = types.SimpleNamespace(seq=seq, hidden=shape["hidden"], heads=shape["heads"], ffn_hidden=shape["ffn_hidden"],
                                dtype_bytes=shape["dtype_bytes"], kv_dim=shape["hidden"] * shape["kv_heads"] // shape["heads"],
                                tile_tokens=tile, head_groups=groups)
    return max(layer_heads_moments(inp).values())


def test_group_choices():
    assert group_choices(4, 1) == (1, 2, 4)
    assert group_choices(32, 8) == (1, 2, 4, 8, 16, 32)
    assert group_choices(12, 8) == (1, 2, 4)  # 3, 6, 12: neither divisors nor multiples of 8


def _whole(seq: int, shape: dict = SHAPE) -> int:
    inp = types.SimpleNamespace(arch="llama", seq=seq, hidden=shape["hidden"], heads=shape["heads"],
                                ffn_hidden=shape["ffn_hidden"], dtype_bytes=shape["dtype_bytes"], flash=True,
                                kv_dim=shape["hidden"] * shape["kv_heads"] // shape["heads"], tile_tokens=seq)
    return block_working_bytes(inp)


@pytest.mark.parametrize("seq", [300, 2816, 9000, 22528])
def test_sized_heads_takes_the_cheapest_form_that_fits(seq):
    """Across memories: the layer untiled exactly where its model fits; else what it takes fits (by
    the planner's model) unless it is the finest given; no fewer groups fit with a tile as long as
    the floor; no fewer tiles fit with its groups; and more memory never takes a finer form."""
    floor, most = 256, 4
    last = None
    for mib in (1, 4, 8, 16, 24, 32, 48, 64, 96, 128, 512):
        memory = mib << 20
        whole, tile, groups = sized_heads(seq, 1, **SHAPE, memory=memory, tile_tokens=floor, head_groups=most)
        assert whole == (_whole(seq) <= memory)
        if whole:
            last = (seq + 1, 0)  # coarser than any tiling
            continue
        if (tile, groups) != (min(floor, seq), most):
            assert _peak(seq, tile, groups) <= memory
        for fewer in (g for g in group_choices(4, 1) if g < groups):
            assert _peak(seq, min(floor, seq), fewer) > memory, (mib, fewer)
        if tile < seq and _peak(seq, tile, groups) <= memory:
            tiles = -(-seq // tile)
            assert _peak(seq, -(-seq // (tiles - 1)), groups) > memory, (mib, tile)
        if last is not None:
            assert groups <= last[1] and (groups < last[1] or tile >= last[0]), (mib, (tile, groups), last)
        last = tile, groups
    assert sized_heads(seq, 1, **SHAPE, memory=512 << 20, tile_tokens=floor, head_groups=most) == (True, seq, 1)
    assert sized_heads(seq, 1, **SHAPE, memory=1, tile_tokens=floor, head_groups=most) == (False, min(floor, seq), most)
    # eager attention keeps its s x s scores: the untiled layer needs more than with flash
    needs = next(m for m in range(1, 4096) if sized_heads(seq, 1, **SHAPE, memory=m << 20, tile_tokens=floor,
                                                          head_groups=most).whole)
    eager = next(m for m in range(1, 1 << 16) if sized_heads(seq, 1, **SHAPE, memory=m << 20, tile_tokens=floor,
                                                             head_groups=most, flash=False).whole)
    assert eager > needs


def test_sized_heads_refuses_bad_input():
    for bad in (dict(memory=0), dict(memory=1.5), dict(tile_tokens=0), dict(head_groups=True)):
        kwargs = {**SHAPE, "memory": 1 << 20, "tile_tokens": 64, "head_groups": 4, **bad}
        with pytest.raises(ValueError, match=f"sized_heads: {next(iter(bad))} must be a positive int"):
            sized_heads(512, 1, **kwargs)


def test_bench_llama_sized_equals_the_same_tiles_by_hand(tmp_path):
    """The bench Llama sized to a memory that takes 2 groups and longer tiles at 384 tokens: gradients
    equal (torch.equal) those of the model tiled so by hand, and with an offloader equal to itself."""
    tokens = torch.randint(0, 256, (2, 384), generator=torch.Generator().manual_seed(3))
    model = _model()
    like = torch.empty(2, 384, 64, device="meta")
    sizes = {m << 10: block_sizes(model.blocks[0], like, 100, 4, m << 10) for m in range(64, 4096, 16)}
    memory = next(m for m, (whole, tile, groups) in sizes.items() if not whole and groups == 2 and tile > 100)
    _, tile, groups = sizes[memory]
    assert groups == 2 and 100 < tile < 384
    tile_layers(model, 100, head_groups=4, layer_memory=memory)
    loss, grads = _step(model, tokens)
    by_hand = _model()
    tile_layers(by_hand, tile, head_groups=groups)
    want_loss, want = _step(by_hand, tokens)
    assert torch.equal(loss, want_loss) and all(torch.equal(grads[n], want[n]) for n in want)
    finest = _model()
    tile_layers(finest, 100, head_groups=4)
    _, fine = _step(finest, tokens)
    assert any(not torch.equal(grads[n], fine[n]) for n in fine)  # another tiling: the sums' order differs
    same_with_offloader(lambda m, off: _step(m, tokens, off), model, tmp_path, loss, grads)
    with pytest.raises(ValueError, match="layer_memory is a positive int of bytes, with head_groups"):
        tile_layers(_model(), 100, layer_memory=memory)


def test_bench_llama_whole_where_it_fits():
    """With memory for the untiled layer, the sized model is the plain one, bit for bit."""
    tokens = torch.randint(0, 256, (2, 384), generator=torch.Generator().manual_seed(3))
    model = _model()
    assert block_sizes(model.blocks[0], torch.empty(2, 384, 64, device="meta"), 100, 4, 1 << 30).whole
    tile_layers(model, 100, head_groups=4, layer_memory=1 << 30)
    loss, grads = _step(model, tokens)
    want_loss, want = _step(_model(), tokens)
    assert torch.equal(loss, want_loss) and all(torch.equal(grads[n], want[n]) for n in want)


def test_hf_sized(tmp_path):
    """long_context(tile="heads", layer_memory=...): with memory for the whole layer, the gradients of
    the layers untiled (the loss in the same chunks); with less, those of the groups and tiles it
    takes asked for by hand; with an offloader equal to itself."""
    from ssdtrain.longctx.hf import long_context
    from ssdtrain.longctx.hf_layer import _sized
    from tests.test_head_groups import CHUNK

    model = long_context(_hf("llama"), tile_tokens=16, loss_chunk=CHUNK, tile="heads", layer_memory=1 << 30).model
    loss, grads = _hf_step(model)
    untiled = long_context(_hf("llama"), tile_tokens=0, loss_chunk=CHUNK).model
    want_loss, want = _hf_step(untiled)
    assert torch.equal(loss, want_loss) and all(torch.equal(grads[n], want[n]) for n in want)
    attn, like = model.model.layers[0].self_attn, torch.empty(2, 128, 64, device="meta")
    memory = next(m << 10 for m in range(16, 4096, 16) if not _sized(attn, like, 16, 2, m << 10).whole
                  and _sized(attn, like, 16, 2, m << 10)[1:] != (16, 2))
    _, tile, groups = _sized(attn, like, 16, 2, memory)
    model = long_context(_hf("llama"), tile_tokens=16, loss_chunk=CHUNK, tile="heads", layer_memory=memory).model
    loss, grads = _hf_step(model)
    by_hand = long_context(_hf("llama"), tile_tokens=tile, loss_chunk=CHUNK, tile="heads", head_groups=groups).model
    want_loss, want = _hf_step(by_hand)
    assert torch.equal(loss, want_loss) and all(torch.equal(grads[n], want[n]) for n in want)
    same_with_offloader(_hf_step, model, tmp_path, loss, grads)
    for bad, match in ((dict(tile="layer", layer_memory=1 << 20), "layer_memory is a positive int of bytes for tile='heads'"),
                       (dict(tile="heads", layer_memory=0), "layer_memory is a positive int of bytes")):
        with pytest.raises(ValueError, match=match):
            long_context(_hf("llama"), **bad)


def test_max_seq_probe_reports_its_sizes(tmp_path, capsys):
    """In the real child, +tiled-heads sized to half the budget by default: each probe says what its
    layers took (here the layer untiled: it fits); --layer-memory 0 keeps the given groups and tiles."""
    out = tmp_path / "max.json"
    common = ["--max-seq", "--device", "cpu", "--model", "llama", "--layers", "2", "--hidden", "32", "--heads", "4",
              "--vocab", "64", "--start-seq", "64", "--max-seq-limit", "64", "--memory-budget", "8GiB",
              "--tile-tokens", "16", "--pairs", "1", "--head-groups", "2", "--modes", "recompute+offload+tiled-heads",
              "--path", str(tmp_path / "nvme"), "--no-progress", "--json", str(out)]
    assert bench_main(common) == 0
    assert "fewer and longer tiles where a layer fits 4096 MiB" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["layer_memory"] == 4 << 30
    assert [(p["whole_layer"], p["tile_tokens"], p["head_groups"]) for p in data["probes"]] == [(True, 64, 1)]
    assert bench_main(common + ["--layer-memory", "0"]) == 0
    data = json.loads(out.read_text())
    assert data["layer_memory"] is None and all("head_groups" not in p for p in data["probes"])
    assert bench_main(common[:-9] + ["--modes", "recompute", "--layer-memory", "1MiB"]) == 2
    assert "--layer-memory (1048576) is a size >= 0 for the +tiled-heads modes" in capsys.readouterr().err
