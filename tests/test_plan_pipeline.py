"""Tests for the planner's pipeline model (issue 66): Megatron-Core's interleaved schedule, the
compute rate per micro-batch size, backward's own rate, and the data-parallel all-reduce."""

import pytest

from ssdtrain.planner import plan as P
from ssdtrain.planner.plan_model import inflight_layers


def _inp(**kw):
    base = dict(layers=8, hidden=1024, heads=16, seq=2048, vocab=32000, gpus=8, gpu_mem_gib=80,
                global_batch=64, dtype="bf16", flash=True, host_gbps=0.0)
    base.update(kw)
    return P.Inputs(**base)


def test_inflight_layers_plain_and_interleaved():
    # Plain 1F1B: the first stage holds p micro-batches (at most m), the last one.
    assert inflight_layers(4, 2, 8) == (8, 4)
    assert inflight_layers(4, 4, 2) == (8, 4)
    # Interleaved, 2 stages of 2 chunks: warm-up 2(p-1) + (v-1)p = 4 chunk forwards on the first
    # stage, (v-1)p = 2 on the last; one more each before the first backward; a chunk is 2 layers.
    assert inflight_layers(4, 2, 8, 2) == (10, 6)
    # 4 stages of 2 chunks: first 2*3 + 4 + 1 = 11 chunks, last 4 + 1 = 5; never more than m v.
    assert inflight_layers(8, 4, 8, 2) == (44, 20)
    assert inflight_layers(4, 2, 2, 2) == (8, 6)


def test_interleaved_point_shortens_the_bubble_and_holds_more():
    inp = _inp(tflops=100.0)
    plain = P.evaluate(inp, "baseline", 2, 4)
    inter = P.evaluate(inp, "baseline", 2, 4, virtual=2)
    m = plain.num_microbatches
    assert (m, inter.virtual_stages, plain.virtual_stages) == (4, 2, 1)
    assert inter.bubble_fraction == pytest.approx(1 / (2 * 4 + 1))
    slot = plain.step_time_s / (m + 1)
    assert inter.step_time_s == pytest.approx((m + 1 / 2) * slot)
    assert inter.memory_gib > plain.memory_gib
    # Not a valid interleaved split: one stage; layers not a multiple of stages x chunks; micro-batches
    # not a multiple of the stages (Megatron-Core refuses it).
    assert P.evaluate(inp, "baseline", 1, 4, virtual=2) is None
    assert P.evaluate(inp, "baseline", 2, 4, virtual=3) is None
    assert P.evaluate(_inp(global_batch=12, gpus=2), "baseline", 2, 4, virtual=2) is None


def test_best_config_weighs_interleaving_only_when_asked_and_when_it_fits():
    # 4 GPUs all pipeline stages (global batch 4: data parallelism cannot split it) so the bubble matters.
    kw = dict(gpus=4, global_batch=4, stages=4, tflops=100.0)
    assert P.best_config(_inp(**kw), "baseline").virtual_stages == 1
    roomy = P.best_config(_inp(virtual_stages=2, **kw), "baseline")
    assert roomy.virtual_stages == 2
    # A budget between what plain 1F1B and the interleaved schedule hold at that micro-batch.
    plain = P.evaluate(_inp(**kw), "baseline", 4, roomy.micro_batch)
    tight = P.best_config(_inp(virtual_stages=2, gpu_mem_gib=(plain.memory_gib + roomy.memory_gib) / 2 / 0.9, **kw),
                          "baseline")
    assert tight.virtual_stages == 1 or tight.micro_batch < roomy.micro_batch


def test_rate_per_micro_batch():
    inp = _inp(tflops=400.0, tflops_at=((4, 300.0), (1, 100.0), (2, 200.0)))
    assert inp.tflops_at == ((1, 100.0), (2, 200.0), (4, 300.0))
    assert [inp.rate(b) for b in (1, 2, 3, 4, 8)] == [100.0, 200.0, 250.0, 300.0, 300.0]
    assert _inp(tflops=400.0).rate(3) == 400.0
    # The slot of micro-batch 1 runs at 100 TFLOPS: 4x the seconds of the same point at 400.
    slow = P.evaluate(inp, "baseline", 1, 1)
    fast = P.evaluate(_inp(tflops=400.0), "baseline", 1, 1)
    assert slow.step_time_s == pytest.approx(4 * fast.step_time_s)
    # Faster per sequence at 4 than at 1: the planner picks the larger micro-batch where it fits.
    assert P.best_config(inp, "baseline").micro_batch >= 4


def test_backward_rate_and_the_recompute_factor():
    s, h, v = 2048, 1024, 32000
    layer = 24 * s * h * h + 4 * s * s * h
    inp = _inp(tflops=100.0, backward_tflops=50.0, gpus=1, global_batch=1, stages=1)
    forward = 8 * layer + 2 * s * h * v
    assert P.evaluate(inp, "baseline", 1, 1).step_time_s == pytest.approx((forward / 100e12 + 2 * forward / 50e12))
    # Recompute adds the layers' forward again at the forward's rate.
    assert P.evaluate(inp, "recompute", 1, 1).step_time_s == pytest.approx(
        (forward + 8 * layer) / 100e12 + 2 * forward / 50e12)


def test_allreduce_adds_the_gradients_ring_time():
    s, h, v = 2048, 1024, 32000
    base = _inp(tflops=100.0)
    ring = _inp(tflops=100.0, allreduce_gbps=10.0)
    for p in (1, 2, 8):
        dp = 8 // p
        params = -(-8 // p) * (12 * h * h + 13 * h) + (v + s) * h
        extra = 2 * (dp - 1) / dp * params * 2 / 10e9 if dp > 1 else 0.0
        assert P.evaluate(ring, "baseline", p, 1).step_time_s == pytest.approx(
            P.evaluate(base, "baseline", p, 1).step_time_s + extra)


@pytest.mark.parametrize("kw,words", [
    (dict(virtual_stages=0), "--virtual-stages"),
    (dict(tflops_at=((0, 1.0),)), "micro-batch size"),
    (dict(tflops_at=((1, -1.0),)), "must be > 0"),
    (dict(tflops_at=((1, 1.0), (1, 2.0))), "given twice"),
    (dict(tflops_at=(1,)), "each entry"),
    (dict(allreduce_gbps=-1.0), "--allreduce-gbps"),
])
def test_new_pipeline_inputs_are_validated(kw, words):
    with pytest.raises(ValueError, match=words):
        _inp(**kw)


def test_cli_pipeline_flags(capsys):
    args = ["--layers", "8", "--hidden", "1024", "--heads", "16", "--seq", "2048", "--vocab", "32000", "--gpus", "4",
            "--gpu-mem-gib", "80", "--global-batch", "4", "--stages", "4"]
    assert P.main(args + ["--virtual-stages", "2", "--tflops-at", "1:100,2:150", "--allreduce-gbps", "20"]) == 0
    out = capsys.readouterr().out
    assert "4x2" in out  # the chosen baseline configuration: 4 stages of 2 chunks
    assert P.main(args + ["--tflops-at", "1=100"]) == 2
    assert "MICRO_BATCH:TFLOPS" in capsys.readouterr().err
