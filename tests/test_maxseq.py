"""``ssdtrain bench --max-seq`` (``ssdtrain/bench/maxseq.py``): the search, and a smoke run."""

import dataclasses
import json
import mmap
import time

import pytest
import torch

from ssdtrain.bench import _measure, maxseq
from ssdtrain.bench.command import main as bench_main


def test_search_doubles_then_bisects_to_an_eighth():
    tried = []

    def probe(mode, seq):
        tried.append(seq)
        return {"seq": seq, "fits": seq <= 1000, "step_s": seq / 1000}

    longest, probes = maxseq.search("recompute", probe, 64, 1 << 20)
    # Doubling: 64..512 fit, 1024 does not; bisection in multiples of 16 until within 512 / 8.
    assert tried == [64, 128, 256, 512, 1024, 768, 896, 960]
    assert longest == 960 and 1000 - longest <= longest // 8 and len(probes) == len(tried)
    assert maxseq.search("recompute", probe, 2048, 1 << 20)[0] is None  # not even the start fits
    assert maxseq.search("recompute", probe, 64, 256)[0] == 256         # the limit reached


def test_max_seq_smoke(tmp_path, capsys):
    """Two modes of a tiny model, each probe a child process; the table, the JSON's ``max_seq``."""
    out = tmp_path / "max.json"
    rc = bench_main(["--max-seq", "--device", "cpu", "--layers", "2", "--hidden", "32", "--heads", "2",
                     "--vocab", "64", "--start-seq", "64", "--modes", "recompute,recompute+offload",
                     "--memory-budget", "8GiB", "--path", str(tmp_path / "nvme"), "--no-progress",
                     "--json", str(out), "--max-seq-limit", "128"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "longest sequence per mode" in text and "memory budget of 8192 MiB" in text
    data = json.loads(out.read_text())
    assert [(r["mode"], r["max_seq"]) for r in data["max_seq"]] == [("recompute", 128), ("recompute+offload", 128)]
    assert all(r["step_s"] > 0 and r["hit_limit"] for r in data["max_seq"])
    assert data["vs_recompute"]["seq"] == 128 and len(data["vs_recompute"]["step_ratios"]) == 2


def test_max_seq_refuses_bad_input(capsys):
    assert bench_main(["--max-seq", "--device", "cpu", "--memory-budget", "0"]) == 2
    assert "--memory-budget must be a positive size" in capsys.readouterr().err
    assert bench_main(["--max-seq", "--device", "cpu", "--start-seq", "8"]) == 2
    assert "--start-seq must be at least 16" in capsys.readouterr().err


def test_a_gpu_budget_above_its_memory_is_refused_before_any_probe(capsys, monkeypatch):
    import types

    import torch

    from ssdtrain.bench import command

    monkeypatch.setattr(command, "resolve_device", lambda name: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: types.SimpleNamespace(total_memory=8 << 30))
    monkeypatch.setattr(maxseq, "probe_in_child", lambda spec: (_ for _ in ()).throw(AssertionError("probed")))
    assert bench_main(["--max-seq", "--device", "cuda", "--memory-budget", "16GiB"]) == 2
    assert "--memory-budget 16384 MiB is more than cuda:0's 8192 MiB" in capsys.readouterr().err


def test_a_probe_that_does_not_fit_the_budget_says_so():
    cfg = maxseq.cpu_model().replace(layers=2, hidden=32, heads=2, vocab=64, seq=64)
    r = maxseq.probe_in_child({"model": dataclasses.asdict(cfg), "mode": "baseline", "device": "cpu",
                               "dtype": "float32", "batch": 1, "budget": 1, "path": None})
    # Note [a CPU probe stops at its budget]: the step is stopped once over it, with what was seen.
    assert r["fits"] is False and r["over_budget"] is True and r["peak_bytes"] > 1 and r["step_s"] is None
    assert r["stopped_at_step"] == 1 and r["held_bytes"] > 0 and "stopped there" in r["error"]
    assert "over" in maxseq.describe(dict(r, mode="baseline"))


def test_a_probe_within_its_budget_runs_every_step_and_counts_what_the_model_held():
    """A budget the step fits: the pre-warm, the warm-up and the measured step all run; the peak is
    the measured step's growth over the weights and AdamW state, each step's record says both."""
    cfg = maxseq.cpu_model().replace(layers=2, hidden=32, heads=2, vocab=64, seq=64)
    r = maxseq.probe_in_child({"model": dataclasses.asdict(cfg), "mode": "baseline", "device": "cpu",
                               "dtype": "float32", "batch": 1, "budget": 1 << 30, "path": None})
    assert r["fits"] is True and r["step_s"] > 0 and "over_budget" not in r
    warm, measured = r["per_step"]
    assert warm["held_bytes"] > measured["held_bytes"] == r["model_bytes"]  # the warm-up began with gradients
    assert r["peak_bytes"] == measured["growth_bytes"] + r["model_bytes"]


def test_a_growth_between_two_samples_is_caught_at_stop():
    """A step shorter than the sampling interval passes the limit between two samples: stop()'s
    last sample calls over (a tiny probe's warm-up was let through, and stopped a step late)."""
    sampler = _measure.RssSampler(interval=60)
    if not sampler.available:
        pytest.skip("no /proc/self/statm on this system")
    seen = []
    block = mmap.mmap(-1, 8 << 20)
    sampler.start(1 << 20, seen.append)
    block.write(b"\1" * (8 << 20))
    growth = sampler.stop()
    sampler.stop()  # nothing more: called once
    sampler.close()
    block.close()
    assert len(seen) == 1 and seen[0] == growth > 1 << 20


def test_the_sampler_calls_over_once_past_its_limit():
    sampler = _measure.RssSampler(interval=0.001)
    if not sampler.available:
        pytest.skip("no /proc/self/statm on this system")
    seen = []
    # fresh mappings, every page written: resident memory that no allocator had before
    blocks = [mmap.mmap(-1, 8 << 20)]
    sampler.start(1 << 20, seen.append)
    blocks[0].write(b"\1" * (8 << 20))
    deadline = time.monotonic() + 10
    while not seen and time.monotonic() < deadline:
        time.sleep(0.005)
    blocks.append(mmap.mmap(-1, 8 << 20))
    blocks[1].write(b"\1" * (8 << 20))
    time.sleep(0.02)
    growth = sampler.stop()
    sampler.close()
    for block in blocks:
        block.close()
    assert len(seen) == 1 and seen[0] > 1 << 20 and growth >= seen[0]


def test_a_search_cut_off_keeps_its_probes(monkeypatch):
    """``partial`` gets every probe so far after each one (``--json`` is rewritten with them), so a
    search stopped by a time limit still says what it found (the H200's of 2026-11-27 did not)."""
    seen = []

    def fake_child(spec):
        seq = spec["model"]["seq"]
        if len(seen) == 4:
            raise KeyboardInterrupt  # the time limit
        return {"seq": seq, "fits": seq <= 256, "peak_bytes": seq, "step_s": 0.1, "oom": seq > 256, "error": None}
    monkeypatch.setattr(maxseq, "probe_in_child", fake_child)
    args = maxseq.MaxSeqArgs(model=maxseq.cpu_model(), modes=("recompute",), start=64,
                             partial=lambda r: seen.append(json.loads(json.dumps(r))))
    try:
        maxseq.run_max_seq(args)
    except KeyboardInterrupt:
        pass
    assert [len(r["probes"]) for r in seen] == [1, 2, 3, 4] and all(r["partial"] for r in seen)
    assert [(p["mode"], p["seq"], p["fits"]) for p in seen[-1]["probes"]] == [
        ("recompute", 64, True), ("recompute", 128, True), ("recompute", 256, True), ("recompute", 512, False)]


def test_chosen_probes_report_fit_and_misfit(tmp_path):
    """``benchmarks/maxseq_probes.py``: each MODE:SEQ a probe as the search runs it, written to
    --json after each; a length over the budget is reported as not fitting."""
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "probes.json"
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "maxseq_probes.py"
    proc = subprocess.run([sys.executable, str(script), "--layers", "2", "--hidden", "32", "--heads", "2",
                           "--vocab", "64", "--memory-budget", "20MiB", "--path", str(tmp_path / "nvme"),
                           "--probe", "recompute+offload:64", "--probe", "recompute:16384", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    probes = json.loads(out.read_text())["probes"]
    assert [(p["mode"], p["seq"], p["fits"]) for p in probes] == [
        ("recompute+offload", 64, True), ("recompute", 16384, False)]
    assert probes[1]["peak_bytes"] > 20 << 20 and "does not fit" in proc.stdout


def test_a_mode_that_misfits_below_its_longest_is_not_settled(monkeypatch):
    """The side-by-side pairs at recompute's longest: a recompute+offload probe that does not fit
    there (shorter than its longest in the search) is reported, not hidden in a missing ratio
    (H200, 2026-11-27: 65536 in the search, out of memory at 40960)."""
    calls = []

    def fake_child(spec):
        seq, mode = spec["model"]["seq"], spec["mode"]
        calls.append((mode, seq))
        paired = calls.count((mode, seq)) > 1  # probed again: a pair
        fits = seq <= (256 if mode == "recompute" else 512) and not (mode == "recompute+offload" and paired)
        return {"seq": seq, "fits": fits, "peak_bytes": seq, "step_s": 0.1, "oom": not fits, "error": None}
    monkeypatch.setattr(maxseq, "probe_in_child", fake_child)
    args = maxseq.MaxSeqArgs(model=maxseq.cpu_model(), modes=("recompute", "recompute+offload"), start=256,
                             limit=2048, budget_bytes=40 << 20)
    result = maxseq.run_max_seq(args)
    vs = result["vs_recompute"]
    assert [r["max_seq"] for r in result["max_seq"]] == [256, 512] and vs["seq"] == 256
    assert vs["did_not_fit"] == ["recompute+offload", "recompute+offload"] and vs["step_ratio"] is None
    assert "NOT SETTLED: recompute+offload did not fit at 256 tokens in 2 of" in maxseq.format_max_seq(result)
