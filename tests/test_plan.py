"""Tests for ssdtrain/planner/plan.py: the analytic planner."""

import json
import math
import time

import pytest
from _benchmarks import load_benchmark

from ssdtrain.planner import plan as P


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
                global_batch=64, dtype="bf16", flash=True, host_gbps=0.0)  # the drive alone; the tier: its tests
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
    # Long sequences: baseline activations do not fit on one stage, offloading does. The loss in
    # chunks: the whole logits (4 x 16k x 32k bytes, 2 GiB a sequence) would fill the GPU alone.
    inp = _inp(seq=16384, gpu_mem_gib=6, drive_gbps=1000.0, global_batch=16, loss_chunk=1024)
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


# --- the drive-limited model (ssdtrain/planner/plan_drive.py, plan_saves.py, plan_simulate.py) ----------

from ssdtrain.planner import plan_drive as D  # noqa: E402
from ssdtrain.planner import plan_saves as S  # noqa: E402
from ssdtrain.planner import plan_simulate as SIM  # noqa: E402


def _saves(*pairs, needed=None):
    """Saves of the given (bytes, packed_s); needed_s defaults to far in backward, latest first."""
    n = len(pairs)
    needed = needed or [100.0 * (n - i) for i in range(n)]
    return [S.Save(b, t, u) for (b, t), u in zip(pairs, needed)]


def _sim(saves, **kw):
    args = dict(forward_s=4.5, backward_s=1000.0, write_bps=1e9, read_bps=1e9, handoff_bytes=1 << 30, min_bytes=0)
    args.update(kw)
    return SIM.simulate(saves, **args)


FOUR = [(100, 0.0), (100, 1.0), (100, 2.0), (100, 3.0), (100, 4.0)]


def test_fast_drive_frees_everything_but_the_last_save():
    step = _sim(_saves(*FOUR))
    assert (step.saved_bytes, step.eligible_bytes) == (500, 400)
    assert (step.free_bytes, step.tail_bytes, step.written_bytes, step.kept_bytes) == (400, 0, 400, 100)
    assert not step.budget_bound and step.read_wait_s == 0


def test_slow_drive_writes_in_pack_order_only_what_ends_before_the_peak():
    # 50 B/s: save k is queued when save k+1 comes (t = k+1), written in 2 s. Save 0 is done at 3;
    # forward ends at 4.5, so saves 1-3 (done at 5, 6, 7 at the earliest) are not written: they
    # would free nothing before the peak (Note [write what leaves before the peak]).
    step = _sim(_saves(*FOUR), write_bps=50.0)
    assert (step.free_bytes, step.tail_bytes, step.written_bytes, step.kept_bytes) == (100, 0, 100, 400)
    assert step.capacity_bytes == pytest.approx(min(50.0 * 4.5, 1e9 * 1000.0))
    assert step.possible_bytes == pytest.approx(50.0 * 4.5)
    # A later, smaller save still fits the time left: 100 B at 1 s, then 20 B queued at 3 s.
    step = _sim(_saves((100, 0.0), (100, 1.0), (20, 2.0), (200, 3.0)), write_bps=50.0)
    assert (step.free_bytes, step.written_bytes) == (120, 120)
    # The handoff does not change what is written when the drive is the limit.
    assert _sim(_saves(*FOUR), write_bps=50.0, handoff_bytes=1).written_bytes == 100


def test_host_tier_takes_the_earliest_saves_and_spills_what_it_cannot_hold():
    # Saves 0-3 queued at 1, 2, 3, 4 (each when the next comes; the last is held). A tier of 200 B/s
    # copies each in 0.5 s: all four done by 4.5, forward's end; the drive gets nothing.
    step = _sim(_saves(*FOUR), host_bps=200.0, host_capacity=1000, write_bps=1.0)
    assert (step.host_bytes, step.spilled_bytes, step.written_bytes, step.free_bytes) == (400, 0, 0, 400)
    assert step.possible_bytes == 500  # min(drive and tier rates x forward, saved)
    # Room for two: the other two go to the drive (fast here), which frees them before the peak too.
    step = _sim(_saves(*FOUR), host_bps=200.0, host_capacity=200)
    assert (step.host_bytes, step.spilled_bytes, step.written_bytes, step.free_bytes) == (200, 200, 200, 400)
    assert step.possible_bytes == pytest.approx(min(1e9 * 4.5 + 200, 500))
    # A slow tier (40 B/s: 2.5 s a save): save 0 is copied by 3.5, save 1 would end at 6 > 4.5: not
    # copied, and the rest of forward stays (the copy clock closes), the drive too.
    step = _sim(_saves(*FOUR), host_bps=40.0, host_capacity=1000)
    assert (step.host_bytes, step.spilled_bytes, step.written_bytes, step.kept_bytes) == (100, 0, 0, 400)
    # Read back at the tier's rate from backward's start: save 0 needed at 0.5 s, its 100 B take 1 s.
    step = _sim(_saves(*FOUR, needed=[0.5, 0.4, 0.3, 0.2, 0.1]), host_bps=40.0, host_capacity=1000)
    assert step.read_wait_s == pytest.approx(100 / 40.0 - 0.5)
    with pytest.raises(ValueError, match="host_bps"):
        _sim(_saves(*FOUR), host_bps=-1.0)


def test_plan_models_the_host_tier(tmp_path, capsys):
    """``ssdtrain plan`` with the tier (the default) against the drive alone: at a GPU's pace a slow
    drive frees little before the peak, the tier all the checkpoints, and the longest sequence of
    recompute+offload comes near (L x input + block) / block times recompute's."""
    args = ["--layers", "32", "--hidden", "4096", "--heads", "32", "--seq", "32768", "--vocab", "128256",
            "--gpus", "1", "--gpu-mem-gib", "80", "--global-batch", "1", "--trainable-fraction", "0.01",
            "--loss-chunk", "4096", "--drive-gbps", "0.1"]
    plans = {}
    for name, extra in (("drive", ["--host-gbps", "0"]), ("tier", []), ("small", ["--host-gib", "16"])):
        out = tmp_path / f"{name}.json"
        assert P.main(args + extra + ["--json", str(out)]) == 0
        plans[name] = json.loads(out.read_text())
    text = capsys.readouterr().out
    assert "host tier 25 GB/s, 64 GiB per GPU" in text and "no host tier" in text
    drive = plans["drive"]["drive_limited"]["recompute+offload"]["best"]["drive"]
    tier = plans["tier"]["drive_limited"]["recompute+offload"]["best"]["drive"]
    assert tier["host_bytes"] == tier["free_bytes"] >= 32 * 32768 * 4096 * 2  # every block input
    assert tier["host_bytes"] > 10 * drive["free_bytes"]
    assert plans["tier"]["drive_limited"]["host_gbps"] == 25.0 and plans["drive"]["drive_limited"]["host_gbps"] == 0
    gain = {name: p["longest_seq"]["gain"]["model"] for name, p in plans.items()}
    assert gain["tier"] > 1.5 * gain["drive"]  # x2.12 against x1.04 (recompute: 141312 tokens)
    # 64 GiB of host memory holds the block inputs of about 260k tokens; 16 GiB, a quarter.
    assert gain["drive"] < gain["small"] < gain["tier"] <= plans["tier"]["longest_seq"]["gain"]["predicted"]
    with pytest.raises(ValueError, match="--host-gib"):
        _inp(host_gib=-1.0)


def test_min_bytes_keeps_small_saves_and_the_last_eligible_waits():
    saves = _saves((100, 0.0), (5, 1.0), (100, 2.0), (100, 3.0), (5, 4.0))
    step = _sim(saves, min_bytes=10)
    # Eligible: saves 0, 2, 3; the last of them (3) is never written, the small ones stay.
    assert (step.eligible_bytes, step.free_bytes, step.kept_bytes) == (200, 200, 110)
    # Save 0 is queued when save 2 (the next eligible one) comes, at t=2: at 50 B/s it would be
    # done at 4, after forward's end at 3.9: not written.
    step = _sim(saves, min_bytes=10, write_bps=50.0, forward_s=3.9)
    assert (step.free_bytes, step.tail_bytes, step.written_bytes) == (0, 0, 0)
    assert _sim(saves, min_bytes=10, write_bps=50.0, forward_s=4.0).free_bytes == 100


def test_reads_too_slow_bind_the_budget_to_the_earliest_saves():
    saves = _saves(*[(100, float(t)) for t in range(4)], needed=[9.0, 6.0, 3.0, 0.0])
    # Read back in reverse from backward's start: save 2 at 100/r (needed at 3), save 1 at 200/r
    # (at 6), save 0 at 300/r (at 9): in time at r >= 33.4 B/s.
    on_time = _sim(saves, forward_s=10.0, backward_s=10.0, read_bps=34.0)
    assert on_time.free_bytes == 300 and not on_time.budget_bound
    late = _sim(saves, forward_s=10.0, backward_s=10.0, read_bps=25.0)
    assert late.read_wait_s == pytest.approx(3.0)  # max(4 - 3, 8 - 6, 12 - 9)
    assert late.budget_bound and (late.free_bytes, late.tail_bytes, late.written_bytes) == (200, 0, 200)
    # A wait under max(10 ms, 1% of the step) is a read's latency, not a drive too slow.
    barely = _sim(saves, forward_s=10.0, backward_s=10.0, read_bps=100 / 3.015)  # save 0 back at 9.045
    assert barely.read_wait_s == pytest.approx(0.045) and not barely.budget_bound and barely.free_bytes == 300


def test_simulate_rejects_bad_rates():
    for bad in (dict(write_bps=0.0), dict(read_bps=-1.0), dict(handoff_bytes=0), dict(min_bytes=-1)):
        with pytest.raises(ValueError, match="must be > 0"):
            _sim(_saves(*FOUR), **bad)


def _bench_saves(**kw):
    args = dict(layers=3, seq=64, hidden=32, heads=4, vocab=100, micro_batch=2, dtype_bytes=4, flash=True,
                dropout=False, checkpoint=False, head=True, tflops=1e-6, backward_tflops=2e-6)
    args.update(kw)
    return S.saves(**args)


@pytest.mark.parametrize("flash,dropout,d", [(True, False, 4), (False, True, 2), (False, False, 2)])
def test_saves_add_up_to_the_formula(flash, dropout, d):
    s, h, a, v, b, L = 64, 32, 4, 100, 2, 3
    saves, fwd, bwd = _bench_saves(flash=flash, dropout=dropout, dtype_bytes=d)
    head = P.head_activation_bytes(s, h, v, b, dtype_bytes=d)
    ids = 8 * s * b  # token ids, and the targets
    assert sum(x.nbytes for x in saves) == L * P.activation_bytes_per_layer(s, h, a, b, dtype_bytes=d, flash=flash,
                                                                          dropout=dropout) + head + 2 * ids
    flops = S.forward_flops(layers=L, seq=s, hidden=h, vocab=v, micro_batch=b)
    assert flops == b * (L * (24 * s * h * h + 4 * s * s * h) + 2 * s * h * v)
    assert fwd == pytest.approx(flops / 1e6) and bwd == pytest.approx(2 * flops / 2e6)
    packed = [x.packed_s for x in saves]
    needed = [x.needed_s for x in saves]
    assert packed == sorted(packed) and needed == sorted(needed, reverse=True)
    assert needed[0] == pytest.approx(bwd) and needed[-1] == 0  # ids needed last, targets first


def test_checkpointed_saves_are_block_inputs_and_backward_recomputes():
    s, h, v, b, L = 64, 32, 100, 2, 3
    saves, fwd, bwd = _bench_saves(checkpoint=True)
    plain_fwd = _bench_saves()[1]
    layer_flops = b * (24 * s * h * h + 4 * s * s * h)
    assert [x.nbytes for x in saves[1:1 + L]] == [4 * s * b * h] * L
    assert fwd == pytest.approx(plain_fwd)
    assert bwd == pytest.approx(2 * S.forward_flops(layers=L, seq=s, hidden=h, vocab=v, micro_batch=b) / 2e6
                                + L * layer_flops / 1e6)
    # A layer's input is needed when its recomputation starts, before that layer's own backward.
    last_layer_input = saves[L]
    assert last_layer_input.needed_s == pytest.approx(2 * 2 * s * h * v * b / 2e6)


def test_in_a_pipeline_a_micro_batch_writes_for_its_slot_and_reads_a_slot_early():
    # 50 B/s: the writes would finish at 3, 5, 7, 9. One step writes and frees only the first
    # (forward ends at 4.5); under 1F1B a slot is forward + backward (4.5 + 5.5 s), so all four
    # are written and freed in time (a stage's peak is later: no write is held back for it).
    one = _sim(_saves(*FOUR), write_bps=50.0, backward_s=5.5)
    piped = _sim(_saves(*FOUR), write_bps=50.0, backward_s=5.5, pipelined=True)
    assert (one.free_bytes, one.tail_bytes, one.written_bytes) == (100, 0, 100)
    assert (piped.free_bytes, piped.tail_bytes, piped.kept_bytes) == (400, 0, 100)
    assert piped.capacity_bytes == 50.0 * 10.0 and one.capacity_bytes == 50.0 * 4.5
    # Reads at 100 B/s, each save needed as backward starts: one step waits 4 s for the 400 B
    # and the budget keeps nearly all; read from 4.5 s before backward, they are back in time.
    now = [0.0] * 5
    late = _sim(_saves(*FOUR, needed=now), read_bps=100.0, backward_s=5.5)
    early = _sim(_saves(*FOUR, needed=now), read_bps=100.0, backward_s=5.5, pipelined=True)
    assert late.budget_bound and late.free_bytes == 0 and late.read_wait_s == pytest.approx(4.0)
    assert not early.budget_bound and early.free_bytes == 400 and early.read_wait_s == 0


def _bench_inp(**kw):
    """The bench model (8 layers, hidden 512, seq 512, batch 4, fp32) on one 'GPU' at ~0.2 TFLOPS."""
    base = dict(layers=8, hidden=512, heads=8, seq=512, vocab=8192, gpus=1, gpu_mem_gib=1024, global_batch=4,
                stages=1, dtype="fp32", dropout=False, tflops=0.18, drive_gbps=2.0, handoff_bytes=32 << 20,
                host_gbps=0.0)
    base.update(kw)
    return P.Inputs(**base)


def test_drive_limited_bench_model():
    fast = D.drive_step(_bench_inp(), "offload", 1, 4)
    # Everything of 1 MiB or more but the log-softmax (the last save, 64 MiB) and the save before
    # it (4 MiB, done after forward's end) is written.
    assert fast.saved_bytes == 8 * 64 * 2**20 + 72 * 2**20 + 2 * 8 * 2048
    assert fast.written_bytes == 516 * 2**20 and fast.tail_bytes == 0
    slow = D.drive_step(_bench_inp(drive_gbps=0.02), "offload", 1, 4)
    # Free: about what the drive writes in forward (less than a save short of it); nothing more is written.
    assert slow.free_bytes <= slow.possible_bytes == slow.capacity_bytes < slow.free_bytes + 16 * 2**20
    assert slow.tail_bytes == 0 and slow.written_bytes == slow.free_bytes
    two = D.drive_step(_bench_inp(drive_gbps=0.02, drives=2), "offload", 1, 4)
    assert two.free_bytes > slow.free_bytes
    ckpt = D.drive_step(_bench_inp(drive_gbps=0.02), "recompute+offload", 1, 4)
    assert ckpt.saved_bytes < slow.saved_bytes and ckpt.backward_s > slow.backward_s
    assert ckpt.free_bytes / ckpt.saved_bytes > slow.free_bytes / slow.saved_bytes
    with pytest.raises(ValueError, match="unknown mode"):
        D.drive_step(_bench_inp(), "baseline", 1, 4)
    # The first of 4 stages (2 layers, no head) under 1F1B: a slot's worth of the drive.
    stage = D.drive_step(_bench_inp(drive_gbps=0.02), "offload", 4, 4)
    assert stage.capacity_bytes == pytest.approx(0.02e9 * (stage.forward_s + stage.backward_s))
    assert stage.tail_bytes == 0 and stage.free_bytes > 0.02e9 * stage.forward_s


def test_plan_has_the_drive_limited_section():
    result = P.plan(_inp(seq=8192, gpu_mem_gib=80, drive_gbps=3.0, tflops=400.0))
    section = result["drive_limited"]
    for mode in D.DRIVE_MODES:
        row = section[mode]
        best = row["best"]
        assert best is not None and best["memory_gib"] <= 80 * (1 - P.RESERVE_FRACTION)
        d = best["drive"]
        assert best["free_bytes_per_step"] == d["free_bytes"] * best["num_microbatches"]
        # Full offload: a micro-batch's saved bytes over what one drive carries in its step.
        assert row["drives_for_full_offload"] == math.ceil(d["saved_bytes"] / d["capacity_bytes"])
        assert row["max_micro_batch"] >= best["micro_batch"]
    text = P.format_plan(result)
    assert "drive-limited" in text and "at no cost" in text and "full offload needs" in text
    # A drive per GPU more: more is offloaded, fewer drives still missing.
    more = P.plan(_inp(seq=8192, gpu_mem_gib=80, drive_gbps=3.0, tflops=400.0, drives=4))["drive_limited"]
    assert more["offload"]["best"]["drive"]["free_bytes"] >= section["offload"]["best"]["drive"]["free_bytes"]


def test_new_inputs_are_validated():
    for bad, flag in ((dict(drives=0), "--drives"), (dict(drive_read_gbps=0.0), "--drive-read-gbps"),
                      (dict(backward_tflops=-1.0), "--backward-tflops"), (dict(min_bytes=-1), "--min-bytes"),
                      (dict(handoff_bytes=0), "--handoff-mib")):
        with pytest.raises(ValueError, match=flag):
            _inp(**bad)
    assert _inp(drive_gbps=2.0).read_gbps == 2.0 and _inp(drive_gbps=2.0, drive_read_gbps=5.0).read_gbps == 5.0


def test_cli_drive_flags(tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc = P.main(["--layers", "8", "--hidden", "512", "--heads", "8", "--seq", "512", "--vocab", "8192",
                 "--gpus", "1", "--gpu-mem-gib", "1024", "--global-batch", "4", "--stages", "1", "--dtype", "fp32",
                 "--no-dropout", "--tflops", "0.18", "--backward-tflops", "0.2", "--drive-gbps", "0.05",
                 "--drive-read-gbps", "0.06", "--drives", "2", "--min-bytes", "0", "--handoff-mib", "32",
                 "--json", str(out)])
    assert rc == 0
    assert "drive-limited" in capsys.readouterr().out
    data = json.loads(out.read_text())
    inputs = data["inputs"]
    assert (inputs["drives"], inputs["drive_read_gbps"], inputs["backward_tflops"], inputs["min_bytes"],
            inputs["handoff_bytes"]) == (2, 0.06, 0.2, 0, 32 << 20)
    section = data["drive_limited"]
    assert section["offload"]["best"]["drive"]["forward_s"] == pytest.approx(
        S.forward_flops(layers=8, seq=512, hidden=512, vocab=8192, micro_batch=4) / 0.18e12)
    rc = P.main(["--layers", "8", "--hidden", "512", "--heads", "8", "--seq", "512", "--vocab", "8192",
                 "--gpus", "1", "--gpu-mem-gib", "1", "--global-batch", "4", "--handoff-mib", "0"])
    assert rc == 2 and "--handoff-mib" in capsys.readouterr().err


def test_plan_vs_bench_smoke(tmp_path, capsys):
    """benchmarks/plan_vs_bench.py at the bench's --quick size, one throttled speed: so that it cannot rot."""
    pytest.importorskip("torch")
    module = load_benchmark("plan_vs_bench")
    out = tmp_path / "pvb.json"
    rc = module.main(["--quick", "--steps", "1", "--rate", "0.5", "--fractions", "10", "--throttle", "backend",
                      "--path", str(tmp_path / "nvme"), "--work-dir", str(tmp_path / "work"), "--json", str(out)])
    assert rc in (0, 1)  # a tiny model on a busy machine need not be within 20%; it must run
    assert "predicted fall" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert [(r["fraction"], r["mode"]) for r in data["records"]] == [(10.0, "offload"), (10.0, "recompute+offload")]
    for record in data["records"]:
        # At this size forward lasts milliseconds: the drive may take nothing before its end.
        assert 0 <= record["predicted_fall_bytes"] <= record["possible_bytes"]
        assert record["measured"]["peak_fall_bytes"] >= 0 and record["measured"]["written_bytes"] >= 0
        assert record["inputs"]["drive_gbps"] == pytest.approx(0.05)
        assert record["command"].startswith("ssdtrain plan --layers 4 ")


def test_the_planner_uses_the_write_budgets_thresholds():
    """plan_simulate keeps its own copy of the budget's thresholds (the planner imports no torch):
    they must be the engine's."""
    from ssdtrain.planner import plan_simulate
    from ssdtrain.engine import schedule

    assert (plan_simulate.DRIVE_BOUND, plan_simulate.MIN_DRIVE_STALL) == (
        schedule.DRIVE_BOUND, schedule.MIN_DRIVE_STALL)


def test_optimizer_bytes_set_the_model_states(tmp_path):
    """``--optimizer-bytes``: AdamW in bf16 with no master copy (the bench's) holds 4 bytes of
    state a parameter, not 12: 8 bytes a parameter in all, and a longer sequence fits."""
    from ssdtrain.planner.plan_model import model_state_bytes

    default, bf16_adam = _inp(), _inp(optimizer_bytes=4)
    assert model_state_bytes(default, 1000, 1) == 16 * 1000
    assert model_state_bytes(bf16_adam, 1000, 1) == 8 * 1000
    assert model_state_bytes(_inp(optimizer_bytes=4, zero=1), 1000, 4) == (2 + 2 + 1) * 1000
    args = ["--layers", "24", "--hidden", "1024", "--heads", "8", "--seq", "4096", "--vocab", "32768", "--gpus", "1",
            "--gpu-mem-gib", "6", "--global-batch", "1", "--loss-chunk", "4096", "--json"]
    longest = {}
    for name, extra in (("default", []), ("bf16", ["--optimizer-bytes", "4"])):
        out = tmp_path / f"{name}.json"
        assert P.main(args + [str(out)] + extra) == 0
        longest[name] = json.loads(out.read_text())["longest_seq"]["modes"]
    assert longest["bf16"]["recompute"]["max_seq"] > longest["default"]["recompute"]["max_seq"] > 0
    with pytest.raises(ValueError, match="--optimizer-bytes"):
        _inp(optimizer_bytes=-1)
