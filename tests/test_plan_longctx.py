"""Tests for ``ssdtrain plan``'s Llama block and its long-context section
(ssdtrain/planner/plan_longctx.py): Llama-3.1-8B on one 80 GB GPU."""

import json

import pytest

from ssdtrain.planner import plan as P
from ssdtrain.planner import plan_layer as LY
from ssdtrain.planner import plan_longctx as LC
from ssdtrain.planner import plan_model as M
from ssdtrain.planner import plan_saves as S

GIB = 1 << 30
KIB = 1 << 10
LLAMA_8B = dict(arch="llama", layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, vocab=128256)


def _llama(**kw):
    """Llama-3.1-8B LoRA on one 80 GB GPU, a chunked loss, 2 TiB of host memory for the tier."""
    base = dict(LLAMA_8B, seq=131072, gpus=1, gpu_mem_gib=80, global_batch=1, trainable_fraction=0.01,
                loss_chunk=4096, host_gib=2048.0, drive_gbps=6.0)
    base.update(kw)
    return P.Inputs(**base)


def test_llama_block_bytes_params_and_flops():
    # Per token: d(6h + 2kv + 4f) + 4a + 8 = 2 x (24576 + 2048 + 57344) + 128 + 8.
    assert LY.llama_activation_bytes_per_layer(1, 4096, 32, 8, 14336) == 168_072
    assert _llama(seq=1000).act_layer(2) == 2 * 1000 * 168_072
    # Eager attention adds the softmax output, a x s^2 x d.
    assert _llama(seq=1000, flash=False).act_layer(1) == 1000 * 168_072 + 32 * 1000 ** 2 * 2
    inp = _llama()
    assert inp.kv_dim == 1024 and inp.tile_tokens == 4096  # tiles default to the hidden size
    # Llama-3.1-8B's published parameter count.
    assert LY.layer_params(inp) == 218_112_000 and M.model_params(inp) == 8_030_261_248
    s = 8192
    flops = LY.layer_forward_flops(inp, s)
    assert flops == 2 * s * 4096 * (2 * 4096 + 2 * 1024 + 3 * 14336) + 2 * s * s * 4096
    # The drive model's saves and FLOPs, op by op, add up to the same block.
    saves, fwd, _ = S.saves(layers=1, seq=s, hidden=4096, heads=32, vocab=128256, micro_batch=1, dtype_bytes=2,
                            flash=True, dropout=True, checkpoint=False, head=False, tflops=1e-12,
                            backward_tflops=1e-12, arch="llama", kv_heads=8, ffn_hidden=14336)
    assert sum(x.nbytes for x in saves) == 8 * s + s * 168_072  # the token ids, then the block
    assert fwd == pytest.approx(flops)
    assert S.forward_flops(layers=32, seq=s, hidden=4096, vocab=128256, arch="llama", heads=32, kv_heads=8,
                           ffn_hidden=14336) == pytest.approx(32 * flops + 2 * s * 4096 * 128256)


def test_optimizer_bytes_per_parameter():
    # Weight and gradient in bf16 (4 bytes) and the optimizer's state: 16, 10, 4 in all.
    for name, gpu, host in (("adamw", 12, 0), ("adamw8bit", 6, 0), ("offloaded", 0, 12)):
        inp = _llama(optimizer=name, trainable_fraction=1.0)
        assert (inp.optimizer_gpu_bytes, inp.optimizer_host_bytes) == (gpu, host)
        assert M.model_state_bytes(inp, 1000, 1) == (4 + gpu) * 1000
    # LoRA: the frozen weights' 2 bytes, the trained 1%'s 16.
    assert M.model_state_bytes(_llama(), 1000, 1) == pytest.approx(1000 * (2 + 0.01 * 14))
    with pytest.raises(ValueError, match="--optimizer"):
        _llama(optimizer="sgd")


def test_working_set_of_the_recomputed_block():
    """The larger of the MLP's and the attention's moment, tiled: the SwiGLU part for one tile."""
    t, h, kv, f, a = 4096, 4096, 1024, 14336, 32
    for s in (8192, 65536, 262144):
        inp = _llama(seq=s)
        attn = s * (2 * (4 * h + 2 * kv) + 4 * a + 4)
        mlp = attn + s * (2 * 2 * h + 4) + s * 2 * 2 * h
        attention = attn + s * (2 * (3 * h + 2 * kv) + 4 * h)
        assert LY.block_working_bytes(inp) == max(mlp + s * 7 * 2 * f, attention) == mlp + s * 7 * 2 * f
        assert LY.block_working_bytes(inp, tiled=True) == max(mlp + t * 7 * 2 * f, attention)
    # Long enough, the attention's moment is the peak: q, k, v, output and their gradients.
    assert LY.block_working_bytes(inp, tiled=True) == attention
    # A tile as long as the sequence is no tiling.
    assert LY.block_working_bytes(_llama(seq=s, tile_tokens=s), tiled=True) == LY.block_working_bytes(inp)


def test_stage_memory_by_hand():
    s = 524288
    inp = _llama(seq=s)
    ckpt = 2 * s * 4096
    states = M.model_state_bytes(inp, M.model_params(inp), 1)
    head = 4 * 4096 * 128256 + 2 * 2 * s * 4096  # one chunk's fp32 logits, the head's two inputs
    work = LY.block_working_bytes(inp, tiled=True) - ckpt  # its input is one of the checkpoints
    assert M._stage_memory(inp, "recompute+offload+tiled", 1, 1, 1) == states + 2 * ckpt + max(work, head + ckpt)
    assert M._stage_memory(inp, "recompute+tiled", 1, 1, 1) == states + 32 * ckpt + max(work, head + ckpt)
    with pytest.raises(ValueError, match="unknown mode"):
        M._stage_memory(inp, "tiled", 1, 1, 1)


def test_llama_8b_lora_one_gpu_host_memory_alone():
    """The issue's case: Llama-3.1-8B LoRA on one 80 GB GPU, chunked loss, host memory for every
    block input: recompute+offload+tiled trains at least 500K tokens with no drive at all."""
    section = LC.long_context(_llama())
    rows = section["modes"]
    assert section["checkpoint_bytes_per_token"] == 256 * KIB  # 32 x 4096 x 2 bytes
    seq = {mode: row["max_seq"] for mode, row in rows.items()}
    best = rows["recompute+offload+tiled"]
    assert best["max_seq"] >= 500_000
    assert best["host_alone_seq"] == best["max_seq"] and best["nvme_bytes"] == 0 and best["drive_gbps_free"] == 0
    assert best["checkpoint_bytes"] == best["host_bytes"] == 256 * KIB * best["max_seq"]
    # Tiling and offloading each buy length.
    assert seq["baseline"] < seq["recompute"] < seq["recompute+tiled"]
    assert seq["recompute"] < seq["recompute+offload"] < seq["recompute+offload+tiled"]
    assert seq["recompute+tiled"] < seq["recompute+offload+tiled"]
    assert best["x_recompute"] == pytest.approx(seq["recompute+offload+tiled"] / seq["recompute"])
    assert best["x_recompute"] > 4
    # Each is the longest that fits (in steps of 256 tokens).
    usable = 80 * GIB * (1 - M.RESERVE_FRACTION)
    for mode, n in seq.items():
        assert LC._memory(_llama(), mode, n) <= usable < LC._memory(_llama(), mode, n + 256), mode


def test_checkpoint_bytes_at_500k_and_1m():
    inp = _llama()
    per_token = LC.long_context(inp)["checkpoint_bytes_per_token"]
    assert per_token * 524288 == 128 * GIB and per_token * 1048576 == 256 * GIB
    assert per_token * 500_000 == 131_072_000_000  # 122 GiB, 131 GB


def test_host_memory_is_divided_among_a_nodes_gpus():
    assert _llama(gpus=8, global_batch=8, node_host_gib=1024.0).host_gib == 128.0
    assert _llama(gpus=8, global_batch=8, node_host_gib=1024.0).gpus_per_node == 8
    assert _llama(gpus=64, global_batch=64, node_host_gib=1024.0).host_gib == 128.0  # at most 8 a node
    assert _llama(gpus=64, global_batch=64, node_host_gib=1024.0, gpus_per_node=4).host_gib == 256.0
    assert _llama(gpus=2, global_batch=2, node_host_gib=1024.0).host_gib == 512.0
    assert _llama(node_host_gib=None, host_gib=48.0).host_gib == 48.0  # --host-gib: per GPU, as before
    with pytest.raises(ValueError, match="--node-host-gib"):
        _llama(node_host_gib=-1.0)


def test_nvme_spill_with_a_128_gib_share():
    """8 GPUs a node, 1 TiB of host memory for the tier: 128 GiB per GPU holds the block inputs of
    524288 tokens; GPU memory allows more, and the drives take the rest."""
    inp = _llama(gpus=8, global_batch=8, node_host_gib=1024.0)
    section = LC.long_context(inp)
    assert section["host_share_gib"] == 128.0
    row = section["modes"]["recompute+offload+tiled"]
    assert row["host_alone_seq"] == 524288 < row["max_seq"]
    ckpt = 256 * KIB * row["max_seq"]
    assert row["checkpoint_bytes"] == ckpt and row["host_bytes"] == 128 * GIB
    assert row["nvme_bytes"] == ckpt - 128 * GIB > 0
    # Time by hand: forward is the blocks' and the head's FLOPs at 400 TFLOPS; backward twice that,
    # plus the blocks, the tiled MLPs and the chunked head recomputed.
    s = row["max_seq"]
    block = 2 * s * 4096 * (2 * 4096 + 2 * 1024 + 3 * 14336) + 2 * s * s * 4096
    head = 2 * s * 4096 * 128256
    fwd = (32 * block + head) / 400e12
    bwd = 2 * fwd + (32 * block + 32 * 6 * s * 4096 * 14336 + head) / 400e12
    assert (row["forward_s"], row["backward_s"]) == (pytest.approx(fwd), pytest.approx(bwd))
    assert row["drive_gbps_free"] == pytest.approx(row["nvme_bytes"] / fwd / 1e9)
    assert row["drive_keeps_up"]  # far under a 6 GB/s drive: at this length compute is slow
    # As the offloader spills today (the last whole block inputs, before forward ends): faster.
    held = int(128 * GIB // (s * 8192))
    assert row["spilled_today_bytes"] == (32 - held) * s * 8192
    assert row["drive_gbps_free_today"] == pytest.approx(
        row["spilled_today_bytes"] / ((32 - held) * block / 400e12 + head / 400e12) / 1e9)
    assert row["drive_gbps_free_today"] > row["drive_gbps_free"]
    # recompute+offload (untiled) fits in the share: nothing spills.
    assert section["modes"]["recompute+offload"]["nvme_bytes"] == 0


def test_no_host_tier_sends_everything_to_the_drives():
    row = LC.long_context(_llama(host_gbps=0.0))["modes"]["recompute+offload+tiled"]
    assert row["host_alone_seq"] is None and row["nvme_bytes"] == row["checkpoint_bytes"]


def test_full_fine_tuning_needs_an_offloaded_or_sharded_optimizer():
    """Full fine-tuning on one 80 GB GPU: AdamW's 16 bytes (128 GB) and 8-bit AdamW's 10 (80 GB) do
    not fit; an offloaded optimizer leaves weights and gradients (4 bytes, 30 GiB) and trains long
    sequences, with its 12 bytes a parameter in host memory."""
    for name in ("adamw", "adamw8bit"):
        rows = LC.long_context(_llama(trainable_fraction=1.0, optimizer=name))["modes"]
        assert all(row is None for row in rows.values()), name
    section = LC.long_context(_llama(trainable_fraction=1.0, optimizer="offloaded"))
    assert section["model_state_gib"] == pytest.approx(4 * 8_030_261_248 / GIB)
    assert section["optimizer_host_gib"] == pytest.approx(12 * 8_030_261_248 / GIB)
    lora = LC.long_context(_llama())["modes"]
    full = section["modes"]
    assert 0 < full["recompute+offload+tiled"]["max_seq"] < lora["recompute+offload+tiled"]["max_seq"]
    # 8-bit AdamW with its states sharded over 8 GPUs (ZeRO-2: gradients too) fits.
    sharded = LC.long_context(_llama(trainable_fraction=1.0, optimizer="adamw8bit", gpus=8, global_batch=8,
                                     zero=2))["modes"]
    assert sharded["recompute+offload+tiled"]["max_seq"] > full["recompute+offload+tiled"]["max_seq"]


def test_cli_model_preset_table_and_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc = P.main(["--model", "llama-3.1-8b", "--seq", "131072", "--gpus", "8", "--global-batch", "8",
                 "--gpu-mem-gib", "80", "--trainable-fraction", "0.01", "--loss-chunk", "4096",
                 "--node-host-gib", "1024", "--drive-gbps", "6", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "long context" in text and "recompute+offload+tiled" in text and "NVMe GiB" in text
    assert "host share 128 GiB per GPU (1024 GiB / 8 GPUs per node)" in text
    assert "to the drives at" in text  # the spill's line
    data = json.loads(out.read_text())
    assert data["inputs"]["arch"] == "llama" and data["inputs"]["kv_heads"] == 8 and data["inputs"]["host_gib"] == 128
    section = data["long_context"]
    assert section == json.loads(json.dumps(LC.long_context(_llama(gpus=8, global_batch=8, node_host_gib=1024.0))))
    # A flag given beside --model wins.
    assert P.main(["--model", "llama-3.1-8b", "--layers", "16", "--seq", "4096", "--gpus", "1",
                   "--global-batch", "1", "--gpu-mem-gib", "80", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["inputs"]["layers"] == 16
    capsys.readouterr()


def test_cli_rejects(capsys):
    base = ["--seq", "4096", "--gpus", "8", "--global-batch", "8", "--gpu-mem-gib", "80"]
    assert P.main(["--model", "llama-3.1-8b", "--host-gib", "64", "--node-host-gib", "1024"] + base) == 2
    assert "not both" in capsys.readouterr().err
    gpt = ["--layers", "2", "--hidden", "256", "--heads", "8", "--vocab", "1000"] + base
    assert P.main(gpt + ["--kv-heads", "2"]) == 2 and "--arch llama" in capsys.readouterr().err
    assert P.main(gpt + ["--arch", "llama", "--kv-heads", "3"]) == 2 and "--kv-heads" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        P.main(["--seq", "4096", "--gpus", "1", "--global-batch", "1", "--gpu-mem-gib", "80"])  # no shape
    assert "--layers" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        P.main(["--model", "llama-3.1-8b", "--optimizer", "adamw8bit", "--optimizer-bytes", "2"] + base)
    capsys.readouterr()


def test_gpt_plans_are_unchanged_and_get_the_section():
    """The default (gpt) model keeps its numbers: the README's Llama-8B-shaped example."""
    inp = P.Inputs(layers=32, hidden=4096, heads=32, seq=131072, vocab=128256, gpus=1, gpu_mem_gib=80,
                   global_batch=1, trainable_fraction=0.01, loss_chunk=4096, drive_gbps=6.0)
    result = P.plan(inp)
    old = {m: r["max_seq"] for m, r in result["longest_seq"]["modes"].items()}
    assert (old["baseline"], old["recompute"], old["recompute+offload"]) == (13312, 141312, 366592)
    new = {m: r["max_seq"] for m, r in result["long_context"]["modes"].items()}
    assert (new["baseline"], new["recompute"]) == (13312, 141312)  # the same memory model
    assert new["recompute+tiled"] > new["recompute"] and new["recompute+offload+tiled"] > new["recompute+offload"]


def test_working_set_with_the_whole_layer_tiled():
    """Llama: of the whole sequence only x, q, k, v, the attention output, the lse and their
    gradients; the peak is attention's backward, the normed copy of x less than the MLP-tiled one's."""
    t, h, kv, f, a, d = 4096, 4096, 1024, 14336, 32, 2
    for s in (8192, 65536, 262144):
        m = LY.layer_tiled_moments(_llama(seq=s))
        whole = s * (d * (3 * h + 2 * kv) + 4 * a)
        assert m == {"whole": whole, "mlp": whole + s * 3 * d * h + t * (d * (3 * h + 7 * f) + 4),
                     "attention": whole + s * (d * (3 * h + 2 * kv) + 4 * h + 4 * a),
                     "qkv": s * d * (4 * h + 2 * kv) + t * (d * (4 * h + 4 * kv) + 4)}
        assert LY.block_working_bytes(_llama(seq=s), layer=True) == max(m.values())
    assert m["attention"] == max(m.values()) == 73_984 * s  # 9.03 x s x h x d
    # Against the MLP alone tiled (the same moment): the normed copy of x and its rstd, less attention's row sum.
    assert LY.block_working_bytes(_llama(seq=s), tiled=True) - m["attention"] == s * (d * h + 4 - 4 * a)
    # Doubling the sequence doubles the whole-sequence part; the tiles' part stays.
    one, two = LY.layer_tiled_moments(_llama(seq=1 << 19)), LY.layer_tiled_moments(_llama(seq=1 << 20))
    assert two["attention"] == 2 * one["attention"] and two["whole"] == 2 * one["whole"]
    tile = t * (d * (3 * h + 7 * f) + 4)
    assert two["mlp"] - tile == 2 * (one["mlp"] - tile)
    # Eager attention: the softmax output and its gradient, s² each.
    s = 8192
    eager = LY.layer_tiled_moments(_llama(seq=s, flash=False))
    assert eager["attention"] == s * d * (6 * h + 4 * kv) + 2 * a * s * s * d
    # gpt in Korthikanti's count (saves only): x, q, k, v, the projection's input, and one tile's rest.
    gpt = P.Inputs(layers=2, hidden=h, heads=a, seq=s, vocab=1000, gpus=1, gpu_mem_gib=80, global_batch=1)
    assert LY.layer_tiled_moments(gpt) == {"whole": s * 5 * d * h, "layer": s * 5 * d * h + t * (11 * d * h + 2 * h)}
    assert 5 * d * h + 11 * d * h + 2 * h == gpt.act_layer(1) // s  # all of it: Korthikanti's 34h


def test_position_wise_flops_are_recomputed_once_more():
    s, inp = 65536, _llama()
    pos = 2 * s * 4096 * (2 * 4096 + 2 * 1024 + 3 * 14336)
    assert LY.position_wise_forward_flops(inp, s) == pos == LY.layer_forward_flops(inp, s) - 2 * s * s * 4096
    block, head = LY.layer_forward_flops(inp, s), 2 * s * 4096 * 128256
    fwd = (32 * block + head) / 400e12
    t = LC.step_seconds(inp, "recompute+offload+tiled-layer", s)
    bwd = 2 * fwd + (32 * (block + pos) + head) / 400e12  # the blocks, their position-wise parts, the head
    assert (t["forward_s"], t["backward_s"]) == (pytest.approx(fwd), pytest.approx(bwd))
    assert LC.step_seconds(inp, "recompute+tiled-layer", s) == t
    assert t["backward_s"] > LC.step_seconds(inp, "recompute+offload+tiled", s)["backward_s"]


def test_layer_tiled_modes_are_longer_than_mlp_tiled():
    for inp in (_llama(), _llama(host_gib=128.0), _llama(gpus=8, global_batch=8, node_host_gib=1024.0),
                P.Inputs(layers=32, hidden=4096, heads=32, seq=131072, vocab=128256, gpus=1, gpu_mem_gib=80,
                         global_batch=1, trainable_fraction=0.01, loss_chunk=4096)):
        seq = {m: r["max_seq"] for m, r in LC.long_context(inp)["modes"].items()}
        assert seq["recompute+tiled-layer"] > seq["recompute+tiled"]
        assert seq["recompute+offload+tiled-layer"] > seq["recompute+offload+tiled"]
    s = 524288
    inp = _llama(seq=s)
    states = M.model_state_bytes(inp, M.model_params(inp), 1)
    ckpt, head = 2 * s * 4096, 4 * 4096 * 128256 + 2 * 2 * s * 4096
    work = LY.block_working_bytes(inp, layer=True) - ckpt
    assert M._stage_memory(inp, "recompute+offload+tiled-layer", 1, 1, 1) == states + 2 * ckpt + max(work, head + ckpt)
    assert M._stage_memory(inp, "recompute+tiled-layer", 1, 1, 1) == states + 32 * ckpt + max(work, head + ckpt)


def test_llama_8b_lora_one_gpu_128_gib_host_whole_layer_tiled():
    """The issue's must-show, as the model honestly says it: Llama-3.1-8B LoRA on one 80 GB GPU with a
    128 GiB host share trains 731,648 tokens under recompute+offload+tiled-layer, not 1M: at 1M tokens
    the recomputed block's attention backward (x, q, k, v, the attention output, their gradients, the
    fp32 dq accumulator: 72.25 GiB) does not fit beside the model states and the two block inputs."""
    inp = _llama(host_gib=128.0)
    row = LC.long_context(inp)["modes"]["recompute+offload+tiled-layer"]
    assert row["max_seq"] == 731_648 < 1 << 20
    assert row["host_bytes"] == 128 * GIB and row["host_alone_seq"] == 524_288
    assert row["nvme_bytes"] == 256 * KIB * 731_648 - 128 * GIB
    assert row["drive_keeps_up"] and row["drive_gbps_free"] < 0.2
    big = _llama(host_gib=128.0, seq=1 << 20)
    m = LY.layer_tiled_moments(big)
    assert max(m, key=m.get) == "attention" and m["attention"] == 72.25 * GIB
    usable = 80 * GIB * (1 - M.RESERVE_FRACTION)
    assert LC._memory(inp, "recompute+offload+tiled-layer", 1 << 20) > usable


def test_old_modes_unchanged_by_the_layer_tiled_ones():
    """The README's example (8 GPUs, 1 TiB of host memory a node): the numbers it printed before."""
    rows = LC.long_context(_llama(gpus=8, global_batch=8, node_host_gib=1024.0))["modes"]
    seq = {m: r["max_seq"] for m, r in rows.items() if not m.endswith("+tiled-heads")}
    assert seq == {"baseline": 10496, "recompute": 114432, "recompute+tiled": 178688, "recompute+tiled-layer": 183296,
                   "recompute+offload": 215552, "recompute+offload+tiled": 666112,
                   "recompute+offload+tiled-layer": 731648}
    assert rows["recompute+offload+tiled"]["step_s"] == pytest.approx(1281.9, abs=0.05)
    assert rows["recompute+offload+tiled"]["nvme_bytes"] / GIB == pytest.approx(34.6, abs=0.05)


def test_llama_8b_lora_one_gpu_past_a_million_tokens_a_head_group_at_a_time():
    """Issue 65's must-show: with attention a group of query heads at a time (the layer tiled whole),
    Llama-3.1-8B LoRA on one 80 GB GPU with a 128 GiB host share trains more than 1,048,576 tokens
    in 16 groups (two query heads each); with the default, one group per key/value head (8), just
    under. The recomputed block's peak is attention's backward: x, y, three gradients and one
    group's q/k/v with theirs; the rest of the block inputs go to NVMe at under 0.2 GB/s."""
    base = _llama(host_gib=128.0)
    default = LC.long_context(base)["modes"]["recompute+offload+tiled-heads"]
    assert base.head_groups == 8 and default["max_seq"] == 1_008_640
    inp = _llama(host_gib=128.0, head_groups=16)
    rows = LC.long_context(inp)["modes"]
    row = rows["recompute+offload+tiled-heads"]
    assert row["max_seq"] == 1_093_376 > 1 << 20 > rows["recompute+offload+tiled-layer"]["max_seq"]
    assert row["host_alone_seq"] == 524_288 and row["nvme_bytes"] == 256 * KIB * row["max_seq"] - 128 * GIB
    assert row["drive_keeps_up"] and row["drive_gbps_free"] < 0.2
    m = LY.layer_heads_moments(_llama(host_gib=128.0, head_groups=16, seq=1 << 20))
    s, h = 1 << 20, 4096
    assert max(m, key=m.get) == "attention"
    assert m["attention"] == s * (5 * 2 * h + 4 * 32) + s * (2 * (7 * 256 + 4 * 128) + 4 * 256) + 4096 * 2 * 2 * (
        h + 256 + 2 * 128)
    # the time: the position-wise parts, q/k/v and attention's forward once more than the layer tiled
    t_layer = LC.step_seconds(inp, "recompute+offload+tiled-layer", 1 << 20)
    t_heads = LC.step_seconds(inp, "recompute+offload+tiled-heads", 1 << 20)
    extra = 32 * (LY.qkv_forward_flops(inp, 1 << 20) + LY.attention_forward_flops(inp, 1 << 20)
                  + 3 * 1 * 4.0 * (1 << 20) * 4096 * 1024) / (inp.tflops * 1e12)
    assert t_heads["step_s"] - t_layer["step_s"] == pytest.approx(extra, rel=1e-9)


def test_head_groups_refused_where_they_do_not_divide():
    with pytest.raises(ValueError, match="--head-groups \\(12\\) must divide --heads"):
        _llama(head_groups=12)
    with pytest.raises(ValueError, match="multiple of the key/value heads"):
        _llama(head_groups=4)
