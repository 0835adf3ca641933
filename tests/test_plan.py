"""Tests for ssdtrain/plan.py: the analytic planner."""

import json
import time

import pytest

from ssdtrain import plan as P


def test_formula_is_korthikanti_for_16bit():
    # sbh(34 + 5as/h): s=2048, h=4096, a=32, b=1 (GPT-3-like layer), worked by hand:
    # sbh = 8_388_608; 34 sbh = 285_212_672; 5 a s^2 = 5*32*2048^2 = 671_088_640.
    assert P.activation_bytes_per_layer(2048, 4096, 32) == 285_212_672 + 671_088_640
    # Flash variant: the s^2 term goes.
    assert P.activation_bytes_per_layer(2048, 4096, 32, flash=True) == 285_212_672
    # Linear in the micro-batch.
    assert P.activation_bytes_per_layer(2048, 4096, 32, 3) == 3 * (285_212_672 + 671_088_640)


@pytest.mark.parametrize("s,h,a,b", [(128, 64, 4, 2), (512, 256, 8, 1), (4096, 8192, 64, 3)])
def test_formula_generalisation(s, h, a, b):
    sbh = s * b * h
    # fp32 (d=4), no dropout: 16 elements of sbh at 4 bytes, softmax output a s^2 at 4 bytes.
    assert P.activation_bytes_per_layer(s, h, a, b, dtype_bytes=4, dropout=False) == 64 * sbh + 4 * a * s * s * b
    assert P.activation_bytes_per_layer(s, h, a, b, dtype_bytes=4, dropout=False, flash=True) == 64 * sbh
    # 16-bit with dropout equals the published formula, written the paper's way.
    assert P.activation_bytes_per_layer(s, h, a, b) == sbh * (34 + 5 * a * s / h)


def _inp(**kw):
    base = dict(layers=8, hidden=1024, heads=16, seq=2048, vocab=32000, gpus=8, gpu_mem_gib=80,
                global_batch=64, dtype="bf16", flash=True)
    base.update(kw)
    return P.Inputs(**base)


def test_evaluate_hand_worked_point():
    inp = _inp(tflops=100.0)
    cfg = P.evaluate(inp, "baseline", 2, 4)
    # 8 GPUs / 2 stages = 4 replicas; 64 / 4 = 16 sequences each = 4 micro-batches of 4.
    assert (cfg.data_parallel, cfg.num_microbatches) == (4, 4)
    assert cfg.bubble_fraction == pytest.approx(1 / 5)
    s, h, v = 2048, 1024, 32000
    fwd_layer = 24 * s * h * h + 4 * s * s * h
    slot = 4 * (4 * fwd_layer * 3 + 6 * s * h * v) / 100e12  # 4 layers + head on the slowest stage
    assert cfg.step_time_s == pytest.approx((4 + 2 - 1) * slot)
    # Memory of the first stage: 4 layers' + embeddings' states at 16 B/param, 2 in flight.
    act = P.activation_bytes_per_layer(s, h, 16, 4, flash=True)
    first = (4 * (12 * h * h + 13 * h) + (v + s) * h) * 16 + 4 * 2 * act
    last = (4 * (12 * h * h + 13 * h) + v * h) * 16 + 4 * act + P.head_activation_bytes(s, h, v, 4)
    assert cfg.memory_gib == pytest.approx(max(first, last) / 2**30)
    # Recompute: a third more layer compute, only layer inputs kept.
    rc = P.evaluate(inp, "recompute", 2, 4)
    assert rc.step_time_s > cfg.step_time_s and rc.memory_gib < cfg.memory_gib
    # Invalid splits.
    assert P.evaluate(inp, "baseline", 3, 4) is None  # 3 does not divide 8 GPUs
    assert P.evaluate(inp, "baseline", 2, 3) is None  # 3 does not divide 16 sequences


def test_everything_fits_means_no_bubble_and_no_offload_writes():
    result = P.plan(_inp(gpu_mem_gib=1000))
    for mode in P.MODES:
        best = result["best"][mode]
        assert best["stages"] == 1 and best["bubble_fraction"] == 0
    assert result["best"]["offload"]["offload_fraction"] == 0
    assert result["best"]["offload"]["step_time_s"] == pytest.approx(result["best"]["baseline"]["step_time_s"])
    # The drive figures describe offloading everything at that configuration.
    assert result["required_write_gbps"] > 0 and result["drive_writes_per_day"] > 0


def test_offload_frees_memory_for_fewer_stages():
    # Long sequences: baseline activations do not fit on one stage, offloading does.
    inp = _inp(seq=16384, gpu_mem_gib=6, drive_gbps=1000.0, global_batch=16)
    result = P.plan(inp)
    base, off = result["best"]["baseline"], result["best"]["offload"]
    assert off["stages"] < base["stages"]
    assert off["bubble_fraction"] < base["bubble_fraction"]
    assert off["step_time_s"] < base["step_time_s"]
    assert result["max_micro_batch"]["offload"] > result["max_micro_batch"]["baseline"]
    assert off["stall_s"] == 0


def test_slow_drive_shows_stall():
    inp_slow = _inp(seq=16384, gpu_mem_gib=6, global_batch=16, drive_gbps=0.1)
    inp_fast = _inp(seq=16384, gpu_mem_gib=6, global_batch=16, drive_gbps=1000.0)
    slow = P.evaluate(inp_slow, "offload", 1, 2, offload_fraction=1.0)
    fast = P.evaluate(inp_fast, "offload", 1, 2, offload_fraction=1.0)
    assert fast.stall_s == 0 and slow.stall_s > 0
    # Required bandwidth is a property of the compute, not of the drive.
    assert slow.required_write_gbps == pytest.approx(fast.required_write_gbps)
    # Each of the m slots stretches to the time the drive needs for one micro-batch's writes.
    m, p = slow.num_microbatches, slow.stages
    slot = fast.step_time_s / (m + p - 1)
    per_mb = slow.written_bytes_per_step / m
    assert slow.stall_s == pytest.approx(m * (per_mb / 0.1e9 - slot))
    assert slow.step_time_s == pytest.approx(fast.step_time_s + slow.stall_s)
    assert "cannot keep up" in P.format_plan(P.plan(inp_slow))


def test_max_micro_batch_is_the_largest_that_fits():
    inp = _inp(seq=8192, gpu_mem_gib=80, stages=2)
    usable = 80 * 2**30 * (1 - P.RESERVE_FRACTION)
    for mode in P.MODES:
        b = P.max_micro_batch(inp, mode, 2)
        assert b >= 1
        assert P._stage_memory(inp, mode, 2, b, 2) <= usable < P._stage_memory(inp, mode, 2, b + 1, 2)
    assert P.max_micro_batch(_inp(gpu_mem_gib=0.001), "baseline", 1) == 0


def test_nothing_fits():
    result = P.plan(_inp(gpu_mem_gib=0.01))
    assert all(result["best"][m] is None for m in P.MODES)
    assert result["required_write_gbps"] is None and result["drive_writes_per_day"] is None
    assert "no fitting configuration" in P.format_plan(result)


def test_input_validation():
    with pytest.raises(ValueError, match="heads"):
        _inp(heads=3)
    with pytest.raises(ValueError, match="stages"):
        _inp(stages=3)
    with pytest.raises(ValueError, match="dtype"):
        _inp(dtype="fp8")


def test_cli_json_and_speed(tmp_path, capsys):
    out = tmp_path / "plan.json"
    t0 = time.perf_counter()
    rc = P.main(["--layers", "80", "--hidden", "8192", "--heads", "64", "--seq", "8192",
                 "--vocab", "128256", "--gpus", "64", "--gpu-mem-gib", "80",
                 "--global-batch", "1024", "--json", str(out)])
    elapsed = time.perf_counter() - t0
    assert rc == 0
    text = capsys.readouterr().out
    assert "baseline" in text and "offload" in text and "drive-writes per day" in text
    data = json.loads(out.read_text())
    assert data["activation_bytes_per_layer"] == P.activation_bytes_per_layer(8192, 8192, 64, flash=True)
    for mode in P.MODES:
        assert mode in data["max_micro_batch"]
        best = data["best"][mode]
        if best is not None:
            for key in ("stages", "micro_batch", "num_microbatches", "bubble_fraction",
                        "step_time_s", "memory_gib"):
                assert key in best
    assert "required_write_gbps" in data and "drive_writes_per_day" in data
    del elapsed  # speed is reported, never asserted (no wall-clock checks in tests)


def test_cli_rejects_bad_input(capsys):
    rc = P.main(["--layers", "8", "--hidden", "100", "--heads", "3", "--seq", "8", "--vocab", "8",
                 "--gpus", "1", "--gpu-mem-gib", "1", "--global-batch", "1"])
    assert rc == 2 and "divisible" in capsys.readouterr().err


# --- the planner against the bytes the bench's decoder really saves (CPU, fp32) ---------------

def _measure_saved_bytes(model, tokens, targets):
    """Unique storages saved for backward (parameters and buffers excluded), in and out of blocks."""
    import torch

    excluded = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    in_block = [False]
    seen = {"blocks": {}, "all": {}}

    def pack(t):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in excluded:
            seen["all"][key] = storage.nbytes()
            if in_block[0]:
                seen["blocks"][key] = storage.nbytes()
        return t

    handles = []
    for block in model.blocks:
        handles.append(block.register_forward_pre_hook(lambda *_: in_block.__setitem__(0, True)))
        handles.append(block.register_forward_hook(lambda *_: in_block.__setitem__(0, False)))
    # Keep the graph (and so every saved storage) alive while counting, so addresses are unique.
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens, targets)
    for h in handles:
        h.remove()
    del loss
    return sum(seen["blocks"].values()), sum(seen["all"].values())


@pytest.mark.parametrize("flash", [True, False])
def test_estimate_within_15_percent_of_real_saved_bytes(flash):
    """Variant compared: fp32 (d=4), no dropout, SDPA flash (no s^2 term) or naive attention."""
    torch = pytest.importorskip("torch")
    from ssdtrain.bench.models import GPT, GPTConfig

    cfg = GPTConfig(vocab=256, seq=128, layers=3, hidden=64, heads=4, flash=flash)
    b = 2
    torch.manual_seed(0)
    model = GPT(cfg)
    tokens = torch.randint(0, cfg.vocab, (b, cfg.seq))
    blocks, total = _measure_saved_bytes(model, tokens, tokens)
    per_layer = P.activation_bytes_per_layer(cfg.seq, cfg.hidden, cfg.heads, b,
                                             dtype_bytes=4, flash=flash, dropout=False)
    assert blocks / cfg.layers == pytest.approx(per_layer, rel=0.15)
    estimate = cfg.layers * per_layer + P.head_activation_bytes(cfg.seq, cfg.hidden, cfg.vocab, b, dtype_bytes=4)
    assert total == pytest.approx(estimate, rel=0.15)
