"""The pipeline-bubble benchmark (benchmarks/pipeline_bubbles.py, issue 66) at its smallest: each
engine's 2-stage 1F1B pipeline over gloo, one step with and without offloading. The losses are
equal, the offloader took bytes, and each rank's bubble is measured from its timeline: the
events are 1F1B's order and the idle share reported is the one the events give.

Skips an engine that is not installed (``pip install megatron-core==0.16.1 deepspeed``)."""

from __future__ import annotations

import argparse
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


def _args(tmp_path) -> argparse.Namespace:
    return argparse.Namespace(shape=SHAPE, global_batch=GLOBAL_BATCH, steps=1, warmup=0, timeout=600,
                              storage=str(tmp_path), budget_mib=10**6)


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
    args = _args(tmp_path)
    cfg = {"stages": 2, "virtual": 1, "micro_batch": 1}
    plain = pipeline_bubbles.probe(engine, "baseline", cfg, args)
    off = pipeline_bubbles.probe(engine, "offload", cfg, args)
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
