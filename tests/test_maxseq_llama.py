"""``ssdtrain bench --max-seq --model llama``: the Llama-shaped decoder, its tiled modes, the bound."""

import json

import pytest
import torch

from ssdtrain.bench import maxseq
from ssdtrain.bench.command import main as bench_main
from ssdtrain.bench.models import Llama, LlamaConfig
from ssdtrain.bench.tiled_models import tile_mlps

from _equiv import step

MLP_WEIGHTS = (".mlp.gate.", ".mlp.up.", ".mlp.down.")


def test_llama_shape():
    cfg = LlamaConfig(layers=2, hidden=64, heads=4, vocab=64)
    assert (cfg.n_kv, cfg.n_ffn) == (1, 224)  # 4 query heads a key/value head, SwiGLU at 3.5 x hidden
    model = Llama(cfg)
    attn, mlp = model.blocks[0].attn, model.blocks[0].mlp
    assert attn.k.weight.shape == (16, 64) and attn.q.weight.shape == (64, 64) and mlp.gate.weight.shape == (224, 64)
    assert model.head.weight is not model.tok_emb.weight and Llama(cfg.replace(tie=True)).head.weight.shape == (64, 64)
    with pytest.raises(ValueError, match="even"):
        LlamaConfig(hidden=60, heads=4)


def _grads(model, tokens, off=None):
    """The shared harness's step (tests/_equiv.py), its gradients by parameter name."""
    loss, grads = step(model, lambda: model(tokens, tokens), off)
    return loss, dict(zip((n for n, _ in model.named_parameters()), grads))


def test_tiled_and_offloaded_gradients_match_the_plain_recompute(tmp_path):
    """recompute+offload+tiled against recompute (untiled, no offloader), float32 on the CPU: the
    loss and every gradient but the MLP weights' equal (tiles of 16 rows: the BLAS gives a slice of
    rows exactly those rows of the whole product); the MLP weights' gradients are sums over tokens
    that the tiles split, equal up to the order of the additions. With and without the offloader,
    the tiled model's gradients are equal."""
    import ssdtrain

    torch.manual_seed(0)
    cfg = LlamaConfig(layers=3, hidden=32, heads=4, vocab=64, loss_chunk=48)
    plain = Llama(cfg)
    tiled = Llama(cfg)
    tiled.load_state_dict(plain.state_dict())
    plain.recompute = tiled.recompute = True
    tile_mlps(tiled, 16)
    tokens = torch.randint(0, cfg.vocab, (2, 96))
    loss0, g0 = _grads(plain, tokens)
    loss1, g1 = _grads(tiled, tokens)
    off = ssdtrain.Offloader(tiled, path=str(tmp_path / "nvme"), min_bytes=0)
    try:
        loss2, g2 = _grads(tiled, tokens, off)
        assert off.stats().unique_bytes > 0  # the block inputs went through it
    finally:
        off.close()
    assert torch.equal(loss1, loss2) and all(torch.equal(g1[n], g2[n]) for n in g1)
    assert torch.equal(loss0, loss1)
    for n in g0:
        if any(w in n for w in MLP_WEIGHTS):
            # 6 tiles' partial sums, added in turn: within a few roundings of the largest entry
            # (measured: at most 6.9e-7 of it)
            bound = 2 * 6 * torch.finfo(torch.float32).eps * g0[n].abs().max()
            assert (g0[n] - g1[n]).abs().max() <= bound, n
        else:
            assert torch.equal(g0[n], g1[n]), n


def test_llama_max_seq_smoke(tmp_path, capsys):
    """The four modes of a tiny Llama, each probe a child process: each mode's row, the tiled and
    offloaded modes at least as long as their peers, the side-by-side step ratios, the bound."""
    out = tmp_path / "max.json"
    rc = bench_main(["--max-seq", "--device", "cpu", "--model", "llama", "--layers", "2", "--hidden", "32",
                     "--heads", "4", "--vocab", "64", "--start-seq", "64", "--max-seq-limit", "128",
                     "--memory-budget", "8GiB", "--tile-tokens", "16", "--pairs", "1", "--path", str(tmp_path / "nvme"),
                     "--no-progress", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "Llama-shaped, 2 blocks, hidden 32, 4 query heads / 1 key-value heads, SwiGLU 112" in text
    data = json.loads(out.read_text())
    assert data["arch"] == "llama" and data["tile_tokens"] == 16
    longest = {r["mode"]: r["max_seq"] for r in data["max_seq"]}
    assert list(longest) == list(maxseq.LLAMA_MAX_SEQ_MODES) and all(longest.values())
    assert longest["recompute+tiled"] >= longest["recompute"] and longest["recompute+offload"] >= longest["recompute"]
    assert longest["recompute+offload+tiled"] >= max(longest["recompute+tiled"], longest["recompute+offload"])
    every = data["vs_recompute_all"]
    assert set(every) == set(maxseq.LLAMA_MAX_SEQ_MODES[1:]) and all(len(v["step_ratios"]) == 1 for v in every.values())
    assert data["vs_recompute"]["mode"] == "recompute+offload+tiled"
    blocks = data["blocks"]
    assert blocks["input_bytes"] == 128 * 32 * 4 and blocks["block_tiled_bytes"] < blocks["block_bytes"]
    assert blocks["bound"] == pytest.approx((2 * blocks["input_bytes"] + blocks["block_bytes"]) / blocks["block_tiled_bytes"])
    assert "of the bound" in text


def test_head_groups_mode_smoke(tmp_path, capsys):
    """``+tiled-heads`` in the real child (attention in 2 groups of query heads): its row, the
    headline mode, its block's bytes and bound, and the groups named in the table's header."""
    out = tmp_path / "max.json"
    rc = bench_main(["--max-seq", "--device", "cpu", "--model", "llama", "--layers", "2", "--hidden", "32",
                     "--heads", "4", "--vocab", "64", "--start-seq", "64", "--max-seq-limit", "128",
                     "--memory-budget", "8GiB", "--tile-tokens", "16", "--pairs", "1", "--head-groups", "2",
                     "--modes", "recompute,recompute+offload+tiled-heads", "--path", str(tmp_path / "nvme"),
                     "--no-progress", "--json", str(out)])
    assert rc == 0
    assert "+tiled-heads: attention in 2 groups of query heads" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["head_groups"] == 2 and [r["max_seq"] for r in data["max_seq"]] == [128, 128]
    assert data["vs_recompute"]["mode"] == "recompute+offload+tiled-heads"
    blocks = data["blocks"]
    assert 0 < blocks["block_heads_bytes"] < blocks["block_bytes"]
    assert blocks["bound_heads"] == pytest.approx((2 * blocks["input_bytes"] + blocks["block_bytes"])
                                                  / blocks["block_heads_bytes"])
    assert bench_main(["--max-seq", "--device", "cpu", "--model", "llama", "--head-groups", "2"]) == 2
    assert "--head-groups (2) is a positive int for the +tiled-heads modes" in capsys.readouterr().err


def test_tiled_modes_search_longer_where_a_step_holds_less(monkeypatch):
    """The search and its table with a probe whose peak is each mode's bytes a token (a model of
    the CPU's figures): each mode's row, in order, and the ratios against recompute."""
    per_token = {"recompute": 18, "recompute+tiled": 14, "recompute+offload": 10, "recompute+offload+tiled": 4}

    def fake_child(spec):
        seq, mode = spec["model"]["seq"], spec["mode"]
        assert spec["arch"] == "llama"
        fits = seq * per_token[mode] <= 18 * 1000
        return {"seq": seq, "fits": fits, "peak_bytes": seq * per_token[mode], "step_s": seq / 1000, "oom": False,
                "error": None}
    monkeypatch.setattr(maxseq, "probe_in_child", fake_child)
    args = maxseq.MaxSeqArgs(model=maxseq.cpu_model("llama"), modes=maxseq.LLAMA_MAX_SEQ_MODES, start=64,
                             limit=1 << 16, bound=False, budget_bytes=40 << 20)
    result = maxseq.run_max_seq(args)
    longest = [r["max_seq"] for r in result["max_seq"]]
    assert longest[0] == 960 and longest == sorted(longest) and longest[3] >= 4 * 960
    assert result["vs_recompute"]["mode"] == "recompute+offload+tiled" and result["vs_recompute"]["step_ratio"] == 1.0
    text = maxseq.format_max_seq(result)
    assert "recompute+offload+tiled trains x" in text and "step at rec. longest" in text


def test_bad_llama_modes_are_refused(capsys):
    assert bench_main(["--max-seq", "--device", "cpu", "--model", "llama", "--modes", "recompute,save_on_cpu+tiled"]) == 2
    assert "--modes: unknown save_on_cpu+tiled" in capsys.readouterr().err
    assert bench_main(["--max-seq", "--device", "cpu", "--kv-heads", "2"]) == 2
    assert "--kv-heads is for --model llama" in capsys.readouterr().err
