"""Tests for ssdtrain/bench/ (``ssdtrain bench``): the run, the drive limit, the measuring helpers."""

import copy
import io
import json
import os
import sys

import pytest
import torch

import ssdtrain
from ssdtrain import bench
from ssdtrain.bench import _measure, drive, modes, runner
from ssdtrain.bench._progress import Progress
from ssdtrain.bench.models import GPT, GPTConfig

KEYS = ("step_time_s", "forward_s", "backward_s", "peak_saved_bytes", "peak_rss_bytes", "written_bytes",
        "read_bytes", "stall_s")


def _run_quick(tmp_path, capsys, data, *extra):
    out = tmp_path / "bench.json"
    rc = bench.main(["--quick", "--steps", "1", "--data", data, "--probe-size", "8MiB",
                     "--path", str(tmp_path / "nvme"), "--work-dir", str(tmp_path / "work"),
                     "--json", str(out), "--no-progress", *extra])
    assert rc == 0
    text = capsys.readouterr().out
    return text, json.loads(out.read_text())


def _check(text, result, backend):
    for mode in bench.MODES:
        assert f"\n{mode} " in text
    assert "drive:" in text and "step" in text and "peak saved" in text
    assert result["input"]["backend"] == backend
    d = result["drive"]
    assert d["write_gbps"] is None or d["write_gbps"] > 0
    assert d["read_gbps"] is None or d["read_gbps"] > 0
    ms = result["modes"]
    for mode in bench.MODES:
        for key in KEYS:
            assert key in ms[mode], (mode, key)
        assert ms[mode]["step_time_s"] > 0
    base, rec, off, rpo = ms["baseline"], ms["recompute"], ms["offload"], ms["recompute+offload"]
    assert base["written_bytes"] == base["read_bytes"] == 0 and base["stall_s"] == 0
    # At --quick size every activation fits the read-ahead window, so backward may find all of
    # them still in memory (reads are then rightly zero); never more is read than was written.
    # The first (warm-up) step writes; a timed one may write less, or nothing, if the offloader
    # learnt that the drive (on a busy machine) could not bring it back in time.
    for name, o in (("offload", off), ("recompute+offload", rpo)):
        assert result["offload"][name]["written_bytes_all_steps"] > 0
        assert 0 <= o["read_bytes"] <= o["written_bytes"]
        assert "drive could carry" in text and o["drive"]["moved_bytes"] == o["written_bytes"]
        assert 0 < o["peak_saved_bytes"]
    assert 0 < rec["peak_saved_bytes"] < base["peak_saved_bytes"]
    assert off["peak_saved_bytes"] <= base["peak_saved_bytes"]
    assert base["step_time_ratio"] == 1.0
    assert "recompute+offload vs recompute: step x" in text and rpo["vs_recompute"]["step_time_ratio"] > 0
    # Same initial weights and batches: offloading changes no bit of training.
    assert off["losses"] == base["losses"]
    assert rpo["losses"] == rec["losses"]
    assert rec["losses"] == pytest.approx(base["losses"], rel=1e-5)


def test_quick_end_to_end_torch_input(tmp_path, capsys):
    text, result = _run_quick(tmp_path, capsys, "torch")
    _check(text, result, "torch")
    assert result["drive"]["limit"] is None and "drive limit" not in text
    assert not list((tmp_path / "nvme").rglob("*"))  # nothing left on the drive


def test_quick_end_to_end_dali_input_with_plot(tmp_path, capsys):
    pytest.importorskip("nvidia.dali")
    pytest.importorskip("matplotlib")
    text, result = _run_quick(tmp_path, capsys, "dali", "--plot", str(tmp_path / "mem.png"))
    _check(text, result, "dali")
    assert (tmp_path / "mem.png").stat().st_size > 0
    assert "timeline" not in result  # kept for the plot, not written to JSON


def test_drive_limit_in_the_backend(tmp_path, capsys):
    cap = 0.05
    text, result = _run_quick(tmp_path, capsys, "torch", "--modes", "baseline,offload,recompute,recompute+offload",
                              "--drive-gbps", str(cap), "--throttle", "backend")
    assert result["drive"]["limit"] == {"gbps": cap, "method": "backend", "devices": [], "why": ""}
    assert "drive limit: 0.05 GB/s each way, in the backend" in text
    for name in ("offload", "recompute+offload"):
        assert "throttled to write 0.05 GB/s" in result["offload"][name]["backend"]
        row = result["modes"][name]
        d = row["drive"]
        assert d["write_gbps"] == d["read_gbps"] == cap  # the cap, or the raw drive if slower
        assert d["capacity_bytes"] == pytest.approx(min(d["write_gbps"] * d["forward_s"],
                                                        d["read_gbps"] * d["backward_s"]) * 1e9)
        assert d["moved_share"] == pytest.approx(row["written_bytes"] / d["capacity_bytes"])
        assert d["drive_limited"] == (d["made_gbps"] > cap)
        # The drive writes at most the cap, over the step and the untimed drain after it (medians:
        # a little slack).
        assert row["written_bytes"] / (row["step_time_s"] + row["wait_s"]) <= cap * 1e9 * 1.05
        assert f"{name}: drive could carry" in text
    assert text.count("  regime: drive") == 2
    assert not list((tmp_path / "nvme").rglob("*"))


def test_recompute_offload_gradients_equal_recompute(tmp_path):
    cfg = GPTConfig(vocab=64, seq=32, layers=3, hidden=32, heads=4)
    torch.manual_seed(0)
    ref = GPT(cfg)
    rec = modes.Mode("recompute", copy.deepcopy(ref))
    rpo = modes.Mode("recompute+offload", copy.deepcopy(ref), modes.offloader_factory(str(tmp_path), None))
    tokens = torch.randint(0, cfg.vocab, (2, cfg.seq))
    try:
        for step in range(2):
            rec.forward_backward(tokens, tokens)
            rpo.forward_backward(tokens, tokens)
            if step == 0:
                assert rpo.off.stats().written_bytes > 0  # the checkpoints went to the drive
            for a, b in zip(rec.model.parameters(), rpo.model.parameters()):
                assert torch.equal(a.grad, b.grad)
                assert torch.equal(a, b)  # after the optimizer step too
    finally:
        rpo.close()


def test_summary_takes_the_median_of_per_round_ratios_and_the_drive_figures():
    S = modes.Step
    steps = {"baseline": [S(2.0, 1.0, 1.0, 0.0), S(2.4, 1.2, 1.2, 0.0), S(2.0, 1.0, 1.0, 0.0)],
             "offload": [S(2.1, 1.0, 1.1, 0.0, peak_saved=5, written=300e6, unique=2e9),
                         S(2.1, 1.0, 1.1, 0.0, peak_saved=7, written=300e6, unique=2e9),
                         S(2.2, 1.1, 1.1, 0.0, peak_saved=6, written=300e6, unique=2e9)]}
    memory = {"baseline": {"peak_saved_bytes": 10, "rss_growth_bytes": 20},
              "offload": {"peak_saved_bytes": 1, "rss_growth_bytes": 4}, "block_bytes": 0}
    limit = drive.DriveLimit(0.5, "backend")
    out = runner._summarize(steps, memory, {"write_gbps": 2.0, "read_gbps": 0.4}, limit)
    off = out["offload"]
    assert off["step_time_ratios"] == pytest.approx([1.05, 0.875, 1.1])
    assert off["step_time_ratio"] == pytest.approx(1.05)
    assert off["peak_saved_bytes"] == 7 and off["peak_saved_ratio"] == pytest.approx(0.7)
    assert off["peak_rss_ratio"] == pytest.approx(0.2)
    d = off["drive"]
    # Write at the limit (0.5 < 2.0 raw), read at the raw drive (0.4 < 0.5).
    assert (d["write_gbps"], d["read_gbps"]) == (0.5, 0.4)
    assert d["capacity_bytes"] == pytest.approx(min(0.5 * 1.0, 0.4 * 1.1) * 1e9)
    assert d["moved_share"] == pytest.approx(300e6 / 0.44e9)
    # 2 GB of activations in baseline's 1.0 s forward: faster than the drive writes.
    assert d["made_gbps"] == pytest.approx(2.0) and d["made_per"] == "baseline" and d["drive_limited"]


def test_choose_limit(tmp_path, monkeypatch):
    assert drive.choose_limit([str(tmp_path)], 0.1, "backend") == drive.DriveLimit(0.1, "backend")
    monkeypatch.setattr(drive.os, "geteuid", lambda: 1000)
    auto = drive.choose_limit([str(tmp_path)], 0.1, "auto")
    assert auto.method == "backend" and auto.why == "not root" and "no cgroup: not root" in auto.describe()
    with pytest.raises(ValueError, match="--throttle cgroup: not root; use --throttle backend"):
        drive.choose_limit([str(tmp_path)], 0.1, "cgroup")
    with pytest.raises(ValueError, match="--drive-gbps"):
        drive.choose_limit([str(tmp_path)], 0, "backend")
    assert drive.drive_rates({"write_gbps": None, "read_gbps": 2.0}, auto) == (0.1, 0.1)
    assert drive.drive_rates({"write_gbps": 1.0, "read_gbps": 2.0}, None) == (1.0, 2.0)


def _cgroup_or_skip(path):
    limit = drive.choose_limit([str(path)], 0.05, "auto")
    if limit.method != "cgroup":
        pytest.skip(f"no blkio cgroup here: {limit.why}")
    return limit


def test_blkio_group_moves_the_process_and_back(tmp_path):
    limit = _cgroup_or_skip(tmp_path)
    before = drive._own_group()
    with drive.limited(limit) as group:
        assert drive._own_group() == "/" + os.path.basename(group.dir)
        with open(os.path.join(group.dir, "blkio.throttle.write_bps_device")) as f:
            assert f.read().split() == [limit.devices[0], str(int(0.05e9))]
    assert drive._own_group() == before and not os.path.exists(group.dir)


def test_bad_modes_and_rates(capsys):
    assert bench.main(["--quick", "--modes", "baseline,fast"]) == 2
    assert "fast" in capsys.readouterr().err
    assert bench.main(["--quick", "--drive-gbps", "-1"]) == 2
    assert "--drive-gbps" in capsys.readouterr().err


def test_plot_without_matplotlib_is_one_clear_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    rc = bench.main(["--quick", "--plot", str(tmp_path / "x.png")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "pip install 'ssdtrain[plot]'" in err


def test_probe_missing_reports_none(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ssdtrain.probe", None)
    d = drive.probe([str(tmp_path)], 1 << 20, False)
    assert d["write_gbps"] is None and d["read_gbps"] is None and "probe" in d["error"]


def test_saved_meter_counts_unique_storages_until_freed():
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 16)
    x = torch.randn(8, 16, requires_grad=True)
    meter = _measure.SavedMeter(lin)
    with meter:
        h = lin(x)  # saves x (and the weight, excluded)
        y = (h * h).sum() + (h[:4] * 2).sum()  # h saved twice (as self and other): counted once
    assert meter.bytes == x.untyped_storage().nbytes() + h.untyped_storage().nbytes()
    del h
    y.backward()
    del y
    assert meter.bytes == 0 and meter.peak == 2 * 8 * 16 * 4
    assert meter.timeline[-1][1] == 0


def test_saved_meter_on_recompute_adds_block_inputs_and_recomputed_block():
    cfg = GPTConfig(vocab=64, seq=32, layers=3, hidden=32, heads=4)
    torch.manual_seed(0)
    model = GPT(cfg)
    x = torch.randint(0, cfg.vocab, (2, cfg.seq))
    base = _measure.SavedMeter(model)
    with base:
        model(x, x).backward()
    model.zero_grad()
    model.recompute = True
    block_bytes = _measure.block_saved_bytes(model.blocks[0], 2, cfg.seq, cfg.hidden, torch.float32)
    rec = _measure.SavedMeter(model, recompute_block_bytes=block_bytes)
    with rec:
        model(x, x).backward()
    rec.close()
    assert rec.bytes == 0
    assert 0 < rec.peak < base.peak
    # At least one recomputed block plus the layer inputs the checkpoints hold.
    assert rec.peak >= block_bytes + 2 * cfg.seq * cfg.hidden * 4


def test_rss_sampler_sees_growth():
    sampler = _measure.RssSampler()
    if not sampler.available:
        pytest.skip("no /proc/self/statm")
    sampler.start()
    big = torch.ones(64 << 20, dtype=torch.uint8)  # touched: resident
    growth = sampler.stop()
    sampler.close()
    assert growth >= 48 << 20
    del big


def test_progress_bar():
    stream = io.StringIO()
    bar = Progress(total=4, label="bench", stream=stream, enabled=True, min_interval=0)
    bar.update(note="baseline")
    assert "25%" in stream.getvalue() and "baseline" in stream.getvalue()
    bar.set(4)
    assert "100%" in stream.getvalue()
    bar.close()
    assert stream.getvalue().endswith("\r")
    silent = io.StringIO()
    Progress(total=4, stream=silent).update()  # not a terminal: draws nothing
    assert silent.getvalue() == ""


def test_cli_points_at_the_package():
    from ssdtrain import cli

    assert cli._COMMANDS["bench"][0] == "ssdtrain.bench" and bench.main is bench.command.main
    assert ssdtrain.bench is bench


def test_step_time_benchmark_smoke(tmp_path, capsys):
    """benchmarks/step_time.py at tiny size, throttled, with recompute: so that it cannot rot."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "step_time.py"
    spec = importlib.util.spec_from_file_location("step_time_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "step.json"
    rc = module.main(["--tiny", "--data", "torch", "--path", str(tmp_path / "nvme"), "--work-dir",
                      str(tmp_path / "work"), "--json", str(out), "--recompute", "--drive-gbps", "0.2",
                      "--throttle", "backend"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "median step time offload/baseline" in text and "offload peak saved / baseline saved bytes" in text
    assert "median step time recompute+offload/recompute" in text and "drive could carry" in text
    data = json.loads(out.read_text())
    fig = data["figures"]
    assert fig["step_time_ratio"] > 0 and fig["stall_share"] >= 0 and 0 < fig["resident_share"] <= 1.0
    assert data["recompute_figures"]["step_time_ratio"] > 0
    assert data["bench"]["model"]["layers"] >= 8
