"""The pipeline-bubble benchmark (benchmarks/pipeline_bubbles.py, issue 66) at its smallest: each
engine's 2-stage 1F1B pipeline over gloo, one step with and without offloading. The losses are
equal, the offloader took bytes, and each rank's bubble is measured from its timeline: the
events are 1F1B's order and the idle share reported is the one the events give.

Skips an engine that is not installed (``pip install megatron-core==0.16.1 deepspeed``)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import sys
import warnings

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)
import _pipe_common as common  # noqa: E402
import pipeline_bubbles  # noqa: E402

SHAPE = common.Shape(layers=4, hidden=64, heads=2, seq=64, vocab=256)
GLOBAL_BATCH = 4  # micro-batch 1: 4 micro-batches through 2 stages


def _installed(module: str) -> bool:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            return False


def _args(tmp_path, offload_config=None) -> argparse.Namespace:
    return argparse.Namespace(shape=SHAPE, global_batch=GLOBAL_BATCH, steps=1, warmup=0, timeout=600,
                              storage=str(tmp_path), budget_mib=10**6, offload_config=offload_config or {})


def first_stage_order(stages: int, m: int) -> list[tuple[str, int]]:
    """1F1B's order on the first stage: ``stages - 1`` forwards, then a forward and a backward in
    turn, then the last backwards."""
    order = [("F", i) for i in range(stages - 1)]
    for i in range(m):
        if i + stages - 1 < m:
            order.append(("F", i + stages - 1))
        order.append(("B", i))
    return order


def test_bubble_formula_and_configurations():
    assert pipeline_bubbles.bubble(2, 4) == pytest.approx(1 / 5)
    assert pipeline_bubbles.bubble(2, 8, virtual=2) == pytest.approx(1 / 17)
    assert pipeline_bubbles.bubble(1, 8) == 0
    got = {(c["stages"], c["virtual"], c["micro_batch"]) for c in pipeline_bubbles.configs("megatron", 4)}
    assert got == {(1, 1, 1), (1, 1, 2), (2, 1, 1), (2, 1, 2), (2, 1, 4), (2, 2, 1), (2, 2, 2)}
    assert all(c["virtual"] == 1 for c in pipeline_bubbles.configs("deepspeed", 4))


def test_every_configuration_trains_the_same_sequences():
    """A step's sequences do not depend on how the global batch is split."""
    def step_rows(dp, per_rank, size):
        return sorted(tuple(t.tolist()) for d in range(dp) for i in range(per_rank)
                      for t in common.batch(SHAPE, 3, i, d, size, per_rank)[0])

    assert step_rows(1, 4, 1) == step_rows(2, 2, 1) == step_rows(2, 1, 2) == step_rows(1, 1, 4)


@pytest.mark.parametrize("engine,module", [("megatron", "megatron.core"), ("deepspeed", "deepspeed")])
def test_smallest_pipeline_with_and_without_offloading(engine, module, tmp_path):
    if not _installed(module):
        pytest.skip(f"{module} is not installed")
    cfg = {"stages": 2, "virtual": 1, "micro_batch": 1}
    plain = pipeline_bubbles.probe(engine, "baseline", cfg, _args(tmp_path))
    # --offload-config reaches the offloader: memory first, a write queue of 4 KiB (every save waits its turn)
    strict = {"when_full": "wait", "max_inflight_bytes": 4096}
    off = pipeline_bubbles.probe(engine, "offload", cfg, _args(tmp_path, strict))
    for rec in (plain, off):
        assert "error" not in rec, rec.get("error")
        assert rec["microbatches"] == 4 and rec["dp"] == 1
        assert rec["theory_bubble"] == pytest.approx(1 / 5)
    assert plain["losses"] == off["losses"] and all(x is not None for x in plain["losses"])
    assert plain["offloaded_bytes"] == 0 and off["offloaded_bytes"] > 0
    for r in off["ranks"]:
        assert 0.0 <= r["idle_share"] < 1.0
        # the idle share is the timeline's: 1 - (forwards + backwards) / the pipeline's time
        assert r["idle_share"] == pytest.approx(max(0.0, 1 - r["busy_s"] / r["pipe_s"]), abs=1e-9)
    # JSON keys: the stages as strings
    first, last = off["events_by_stage"]["0"], off["events_by_stage"]["1"]
    assert [(k, i) for k, i, _, _ in first] == first_stage_order(2, 4)
    assert [(k, i) for k, i, _, _ in last] == first_stage_order(1, 4)  # the last stage: F, B in turn
    for events in (first, last):
        assert all(0 <= t0 <= t1 for _, _, t0, t1 in events)
        assert all(a[3] <= b[2] for a, b in zip(events, events[1:]))  # one at a time, in order
    # the offloader's counters come with each rank's record
    assert sum(r["offload_stats"]["written_bytes"] for r in off["ranks"]) == off["offloaded_bytes"]
    assert all(r["offload_stats"] == {} for r in plain["ranks"])
    assert off["offload_config"] == strict
    assert all(r["offload_stats"]["backpressure_waits"] > 0 and r["offload_stats"]["kept_bytes"] == 0 for r in off["ranks"])


# --- the planner beside the measurements (benchmarks/_pipe_planner.py) ---------------------------

def _synthetic(engine, mode, stages, virtual, mb, step_s, pipe_s, peak, forward_s=None, backward_s=None):
    """A probe's record as ``probe`` writes it, with the timings given."""
    m = GLOBAL_BATCH // (mb * (2 // stages))
    events = []
    if forward_s is not None:
        for i in range(m):
            events.append(["F", i, 0.0, forward_s / m])
            events.append(["B", i, 0.0, backward_s / m])
    rank = {"step_s": step_s, "pipe_s": pipe_s, "peak_bytes": peak}
    return {"engine": engine, "mode": mode, "stages": stages, "virtual": virtual, "micro_batch": mb,
            "global_batch": GLOBAL_BATCH, "shape": dataclasses.asdict(SHAPE),
            "step_s": step_s, "tokens_per_s": GLOBAL_BATCH * SHAPE.seq / step_s, "peak_bytes": peak,
            "ranks": [rank, rank], "events_by_stage": {"0": events}}


def test_planner_is_calibrated_on_the_probes_without_a_pipeline():
    import _pipe_planner as planner
    from ssdtrain.planner.plan_model import evaluate

    budget = 64.0
    # Rates the records are made with: forward 2 and 3 GFLOP/s at micro-batch 1 and 2, backward at
    # half the forward's, and 0.25 s of gradient all-reduce beside the pipeline's time.
    unit = planner.calibrated([_synthetic("megatron", "baseline", 1, 1, 1, 1.0, 1.0, 1, 1.0, 1.0)], budget, "megatron")
    unit = type(unit)(**{**vars(unit), "tflops": 1.0, "backward_tflops": None, "tflops_at": (), "allreduce_gbps": 0.0})
    records = []
    for mb, rate in ((1, 2e-3), (2, 3e-3)):
        work = evaluate(unit, "baseline", 1, mb).step_time_s  # TFLOPs: a third forward's
        forward, backward = work / 3 / rate, work * 2 / 3 / (rate / 2)
        records.append(_synthetic("megatron", "baseline", 1, 1, mb, forward + backward + 0.25, forward + backward,
                                  2 << 30, forward, backward))
    inp = planner.calibrated(records, budget, "megatron")
    assert [b for b, _ in inp.tflops_at] == [1, 2]
    assert [r for _, r in inp.tflops_at] == pytest.approx([2e-3, 3e-3])
    assert inp.backward_tflops / inp.tflops == pytest.approx(0.5)
    assert (inp.virtual_stages, inp.tied_head, inp.gpu_mem_gib) == (2, False, budget / 1024)
    for rec in records:  # the planner gives back the steps it was calibrated on, all-reduce included
        assert evaluate(inp, "baseline", 1, rec["micro_batch"]).step_time_s == pytest.approx(rec["step_s"])
    # Neither probe fits 64 MiB; the planner's baseline choice is a pipeline, and the report says
    # whether the measured best is the same
    chosen = planner.choices(records, budget, "megatron")
    assert chosen["baseline"]["stages"] == 2
    c = chosen["baseline"]
    measured = _synthetic("megatron", "baseline", c["stages"], c["virtual"], c["micro_batch"], 9.0, 8.9, 1)
    lines = planner.beside(records + [measured], budget, "megatron")
    assert any(line.strip().startswith("baseline") and line.endswith("the same") for line in lines), lines
    assert planner.beside([], budget, "megatron")[0].startswith("planner (megatron): no baseline probe")


def test_rounds_time_the_calibration_the_best_and_the_planners_choice():
    one, two = {"stages": 1, "virtual": 1, "micro_batch": 2}, {"stages": 2, "virtual": 2, "micro_batch": 1}
    rounds = pipeline_bubbles.timed({"offload": dict(one, tokens_per_s=1.0), "baseline": two},
                                    {"offload": one, "baseline": dict(two, step_s=1.0)}, ["baseline", "offload"], 3,
                                    [{"stages": 1, "virtual": 1, "micro_batch": 1}])
    assert len(rounds) == 3
    assert rounds[0] == [("baseline", {"stages": 1, "virtual": 1, "micro_batch": 1}), ("baseline", two),
                         ("offload", one)]
    differ = pipeline_bubbles.timed({"offload": one}, {"offload": dict(one, micro_batch=1)}, ["offload"], 1)
    assert differ[0] == [("offload", one), ("offload", dict(one, micro_batch=1))]


def test_megatron_interleaved_schedule_holds_what_the_planner_counts(tmp_path):
    """The planner's memory of the interleaved schedule (``inflight_layers``: the chunk forwards a
    stage runs before its first backward, plus one) is what Megatron-Core's schedule does: the
    most forwards not yet backward on each stage, from the probe's timeline."""
    if not _installed("megatron.core"):
        pytest.skip("megatron.core is not installed")
    from ssdtrain.planner.plan_model import inflight_layers

    rec = pipeline_bubbles.probe("megatron", "baseline", {"stages": 2, "virtual": 2, "micro_batch": 1}, _args(tmp_path))
    assert "error" not in rec, rec.get("error")
    held = {}
    for stage, events in rec["events_by_stage"].items():
        n = most = 0
        for kind, _, _, _ in events:
            n += 1 if kind == "F" else -1
            most = max(most, n)
        held[stage] = most
    per_stage = SHAPE.layers // 2  # 2 layers a stage, a chunk of 1
    first, last = inflight_layers(per_stage, 2, rec["microbatches"], 2)
    assert (held["0"], held["1"]) == (first / (per_stage / 2), last / (per_stage / 2)) == (5, 3)
