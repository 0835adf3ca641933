"""Tests for ssdtrain/bench.py (``ssdtrain bench``) and ssdtrain/_progress.py."""

import io
import json
import sys

import pytest
import torch

from ssdtrain import _hostalloc, _measure, bench
from ssdtrain._progress import Progress
from ssdtrain.models import GPT, GPTConfig

@pytest.fixture(autouse=True)
def _keep_malloc_settings(monkeypatch):
    """The bench fixes glibc's mmap threshold process-wide; keep the test process as it was."""
    monkeypatch.setattr(bench, "mmap_large_allocations", lambda *a, **k: False)
    monkeypatch.setattr(bench, "usual_allocations", lambda *a, **k: False)


KEYS = ("step_time_s", "peak_saved_bytes", "peak_rss_bytes", "written_bytes", "read_bytes", "stall_s")


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
        assert mode in text
    assert "drive:" in text and "step" in text and "peak saved" in text
    assert result["input"]["backend"] == backend
    drive = result["drive"]
    assert drive["write_gbps"] is None or drive["write_gbps"] > 0
    assert drive["read_gbps"] is None or drive["read_gbps"] > 0
    modes = result["modes"]
    for mode in bench.MODES:
        for key in KEYS:
            assert key in modes[mode], (mode, key)
        assert modes[mode]["step_time_s"] > 0
    base, rec, off = modes["baseline"], modes["recompute"], modes["offload"]
    assert base["written_bytes"] == base["read_bytes"] == 0 and base["stall_s"] == 0
    # At --quick size every activation fits the read-ahead window, so backward may find all of
    # them still in memory (reads are then rightly zero); never more is read than was written.
    assert off["written_bytes"] > 0 and 0 <= off["read_bytes"] <= off["written_bytes"]
    assert 0 < rec["peak_saved_bytes"] < base["peak_saved_bytes"]
    assert 0 < off["peak_saved_bytes"] <= base["peak_saved_bytes"]
    assert base["step_time_ratio"] == 1.0
    # Same initial weights and batches: offloading changes no bit of training.
    assert off["losses"] == base["losses"]
    assert rec["losses"] == pytest.approx(base["losses"], rel=1e-5)


def test_quick_end_to_end_torch_input(tmp_path, capsys):
    text, result = _run_quick(tmp_path, capsys, "torch")
    _check(text, result, "torch")
    assert not list((tmp_path / "nvme").rglob("*"))  # nothing left on the drive


def test_quick_end_to_end_dali_input_with_plot(tmp_path, capsys):
    pytest.importorskip("nvidia.dali")
    pytest.importorskip("matplotlib")
    text, result = _run_quick(tmp_path, capsys, "dali", "--plot", str(tmp_path / "mem.png"))
    _check(text, result, "dali")
    assert (tmp_path / "mem.png").stat().st_size > 0
    assert "timeline" not in result  # kept for the plot, not written to JSON


def test_plot_without_matplotlib_is_one_clear_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    rc = bench.main(["--quick", "--plot", str(tmp_path / "x.png")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "pip install 'ssdtrain[plot]'" in err


def test_bad_modes(capsys):
    assert bench.main(["--quick", "--modes", "baseline,fast"]) == 2
    assert "fast" in capsys.readouterr().err


def test_probe_missing_reports_none(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ssdtrain.probe", None)
    drive = bench._probe([str(tmp_path)], 1 << 20, False)
    assert drive["write_gbps"] is None and drive["read_gbps"] is None and "probe" in drive["error"]


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


def test_step_time_benchmark_smoke(tmp_path, capsys):
    """benchmarks/step_time.py at tiny size, so the benchmark cannot rot."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "step_time.py"
    spec = importlib.util.spec_from_file_location("step_time_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "step.json"
    control = _hostalloc.available()  # the control mode needs the huge-page allocator (CI has it)
    rc = module.main(["--tiny", "--data", "torch", "--path", str(tmp_path / "nvme"),
                      "--work-dir", str(tmp_path / "work"), "--json", str(out)] + ["--control"] * control)
    assert rc == 0
    text = capsys.readouterr().out
    assert "offload/baseline" in text and "peak_resident_bytes" in text
    fig = json.loads(out.read_text())["figures"]
    assert fig["step_time_ratio"] > 0 and fig["stall_share"] >= 0 and 0 < fig["resident_share"] <= 1.0
    if control:
        assert "host allocator: hugepage" in text and "control: baseline on huge pages / baseline" in text
        assert fig["control_ratio"] > 0 and fig["offload_over_control"] > 0
    result = json.loads(out.read_text())["bench"]
    assert result["model"]["layers"] >= 8
    # The host line, as a busy host would make it: steal per mode, and the rounds where the
    # offloaded step lost more to the host than baseline's.
    base, off = result["modes"]["baseline"], result["modes"]["offload"]
    base.update(stolen_share=0.04, stolen_shares=[0.04] * 12)
    off.update(stolen_share=0.15, stolen_shares=[0.15] * 12, more_stolen_rounds=10, step_time_ratio_unstolen=1.1)
    table = bench.format_table(result)
    assert "(median per step): baseline 4%, offload 15%" in table
    assert "offload steps lost more to the host than baseline's in 10 of 12 rounds (on a virtual disk" in table
    off.update(more_stolen_rounds=9)  # P(>= 9 of 12) = 7.3%: could be chance, so no explanation offered
    assert "in 9 of 12 rounds\n" in bench.format_table(result)


def test_steal_is_reported_and_taken_out_per_step(monkeypatch):
    # Two CPUs; in round 2 the host took 0.8 s of CPU time during baseline's step (0.4 s per CPU).
    monkeypatch.setattr(bench.os, "cpu_count", lambda: 2)
    S = bench._Step
    steps = {"baseline": [S(2.0, 1.0, stolen=0.0), S(2.4, 1.0, stolen=0.8), S(2.0, 1.0, stolen=0.0)],
             "offload": [S(2.1, 1.0, peak_saved=1, stolen=0.0), S(2.1, 1.0, peak_saved=1, stolen=0.0),
                         S(2.2, 1.0, peak_saved=1, stolen=0.0)]}
    out = bench._summarize(steps, {"baseline": (10, None, None), "offload": (1, None, None)}, {})
    off, base = out["offload"], out["baseline"]
    assert off["step_time_ratios"] == pytest.approx([1.05, 0.875, 1.1])
    assert off["step_time_ratio"] == pytest.approx(1.05)
    # Less steal: 2.0 / 2.0, 2.1 / (2.4 - 0.4), 2.2 / 2.0.
    assert off["step_time_ratio_unstolen"] == pytest.approx(1.05)
    assert base["stolen_shares"] == pytest.approx([0.0, 0.8 / 4.8, 0.0])
    assert base["stolen_share"] == 0.0 and off["stolen_share"] == 0.0
    assert off["more_stolen_rounds"] == 0  # round 2's steal hit baseline, not offload
    steps["offload"][2].stolen = 0.44  # 10% of round 3's offload step
    out = bench._summarize(steps, {"baseline": (10, None, None), "offload": (1, None, None)}, {})
    assert out["offload"]["more_stolen_rounds"] == 1
    assert out["offload"]["step_time_ratio_ci95"] is None  # 3 rounds: no 95% interval exists
    # Unknown steal (no /proc/stat): no estimate rather than a wrong one.
    steps["offload"][0].stolen = None
    out = bench._summarize(steps, {"baseline": (10, None, None), "offload": (1, None, None)}, {})
    assert out["offload"]["step_time_ratio_unstolen"] is None and out["offload"]["stolen_share"] is None


def test_median_interval_is_the_binomial_order_statistic_interval():
    # Ranks from the binomial(n, 1/2) tail: 6 values -> 1st..6th (96.9%), 12 -> 3rd..10th
    # (96.1%; 4th..9th would be 85.4%), 30 -> 10th..21st (95.7%).
    assert bench.median_interval([5.0, 1.0, 4.0, 2.0, 3.0]) is None
    assert bench.median_interval([6.0, 1.0, 5.0, 2.0, 4.0, 3.0]) == (1.0, 6.0)
    assert bench.median_interval([float(x) for x in range(12, 0, -1)]) == (3.0, 10.0)
    assert bench.median_interval([float(x) for x in range(1, 31)]) == (10.0, 21.0)
    assert bench.median_interval([float(x) for x in range(1, 13)], coverage=0.8) == (4.0, 9.0)


def test_sign_test_p():
    assert bench.sign_test_p(0, 5) == 1.0
    assert bench.sign_test_p(3, 3) == pytest.approx(1 / 8)
    assert bench.sign_test_p(10, 12) == pytest.approx((66 + 12 + 1) / 4096)
    assert bench.sign_test_p(20, 30) < 0.05 < bench.sign_test_p(19, 30)


def test_stolen_seconds_reads_the_steal_column(monkeypatch, tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 50 1000 3 0 2 250 0 0\ncpu0 50 0 25 500 1 0 1 125 0 0\n")
    real_open = open
    monkeypatch.setattr("builtins.open", lambda p, *a, **k: real_open(stat if p == "/proc/stat" else p, *a, **k))
    assert _measure.stolen_seconds() == pytest.approx(250 / _measure.os.sysconf("SC_CLK_TCK"))


def test_io_interference_benchmark_smoke(tmp_path, capsys):
    """benchmarks/io_interference.py at tiny size, with the offloaded mode, so it cannot rot."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "io_interference.py"
    spec = importlib.util.spec_from_file_location("io_interference_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    (tmp_path / "nvme").mkdir()
    rc = module.main(["--tiny", "--offload", "--huge-pages", "--steps", "1", "--gbps", "0.05", "--batch", "2",
                      "--path", str(tmp_path / "nvme")])
    assert rc == 0
    text = capsys.readouterr().out
    assert "with traffic / quiet" in text and "offloaded / with traffic" in text
    assert "with traffic from huge pages / quiet" in text and "from huge pages / from small pages" in text
    assert list((tmp_path / "nvme").iterdir()) == []  # the traffic file and the arena are gone


def test_io_requests_benchmark_smoke(tmp_path, capsys):
    """benchmarks/io_requests.py at tiny size: counts the drive's requests and context switches."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "io_requests.py"
    spec = importlib.util.spec_from_file_location("io_requests_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--tiny", "--steps", "1", "--batch", "2", "--path", str(tmp_path),
                        "--config", '{"min_bytes": 0}']) == 0
    text = capsys.readouterr().out
    assert "mode: offload, host allocator" in text and "per step:" in text
    assert "training thread" in text and "context switches per step" in text
    assert "page faults" in text and "reused a freed block" in text
