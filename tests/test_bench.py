"""Tests for ssdtrain/bench/ (``ssdtrain bench``): the run, the drive limit, the measuring helpers."""

import copy
import gc
import io
import json
import mmap
import os
import statistics
import sys

import pytest
import torch

import ssdtrain
from ssdtrain import bench
from ssdtrain.bench import _device, _measure, command, drive, modes, runner
from ssdtrain.bench._progress import Progress
from ssdtrain.bench.models import GPT, GPTConfig, preset
from _benchmarks import load_benchmark

KEYS = ("step_time_s", "forward_s", "backward_s", "peak_saved_bytes", "peak_rss_bytes", "written_bytes",
        "read_bytes", "stall_s")


def _run_quick(tmp_path, capsys, data, *extra):
    out = tmp_path / "bench.json"
    rc = bench.main(["--quick", "--device", "cpu", "--steps", "1", "--data", data, "--probe-size", "8MiB",
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
        # Per step, the figures the medians and means are taken of.
        steps = ms[mode]["steps"]
        assert [s["seconds"] for s in steps] == ms[mode]["step_times_s"]
        assert statistics.median(s["forward"] for s in steps) == ms[mode]["forward_s"]
        assert round(statistics.fmean(s["written"] for s in steps)) == ms[mode]["written_bytes"]
    base, rec, off, rpo, soc = (ms[m] for m in ("baseline", "recompute", "offload", "recompute+offload", "save_on_cpu"))
    assert base["written_bytes"] == base["read_bytes"] == 0 and base["stall_s"] == 0
    assert result["model"]["device"] == "cpu" and result["model"]["dtype"] == "float32"  # the CPU's default
    for mode in bench.MODES:  # GPU figures: present, and None on the CPU
        assert ms[mode]["max_memory_allocated_bytes"] is None and ms[mode]["pinned_host_peak_bytes"] is None
        assert ms[mode]["max_memory_allocated_ratio"] is None
    assert "max alloc" not in text and "peak RSS+" in text
    # At --quick size every activation fits the read-ahead window, so backward may find all of
    # them still in memory (reads are then rightly zero); never more is read than was written.
    # The first (warm-up) step writes; a timed one may write less, or nothing, if the offloader
    # learnt that the drive (on a busy machine) could not bring it back in time.
    for name, o in (("offload", off), ("recompute+offload", rpo)):
        assert result["offload"][name]["written_bytes_all_steps"] > 0
        assert 0 <= o["read_bytes"] <= o["written_bytes"]
        assert "drive could carry" in text and o["drive"]["moved_bytes"] == o["written_bytes"]
        assert 0 < o["peak_saved_bytes"]
        # The achieved rates beside the drive's raw ones.
        assert o["drive"]["raw_write_gbps"] == d["write_gbps"] and o["drive"]["raw_read_gbps"] == d["read_gbps"]
        assert f"  achieved write {o['write_gbps']:.2f}, read {o['read_gbps']:.2f} GB/s" in text
        assert set(o["vs"]) == {"baseline", "recompute", "save_on_cpu"}
    assert 0 < rec["peak_saved_bytes"] < base["peak_saved_bytes"]
    assert off["peak_saved_bytes"] <= base["peak_saved_bytes"]
    assert base["step_time_ratio"] == 1.0
    assert rpo["vs_recompute"]["step_time_ratio"] == rpo["vs"]["recompute"]["step_time_ratio"] > 0
    assert "vs (row / column)" in text and "save_on_cpu step" in text and "recompute step" in text
    # save_on_cpu on the CPU: pin_memory=False, which copies nothing; it holds what baseline holds.
    assert result["save_on_cpu"]["pin_memory"] is False and "pin_memory=False" in text
    assert soc["peak_saved_bytes"] == base["peak_saved_bytes"] and soc["written_bytes"] == 0
    assert set(soc["vs"]) == {"baseline", "recompute"} and soc["vs"]["baseline"]["peak_saved_ratio"] == 1.0
    # Same initial weights and batches: offloading changes no bit of training.
    assert off["losses"] == base["losses"]
    assert rpo["losses"] == rec["losses"]
    assert soc["losses"] == base["losses"]
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
        assert d["limit_gbps"] == cap and f"; limited to {cap:g} GB/s each way" in text
        assert d["capacity_bytes"] == pytest.approx(min(d["write_gbps"] * d["forward_s"],
                                                        d["read_gbps"] * d["backward_s"]) * 1e9)
        assert d["moved_share"] == pytest.approx(row["written_bytes"] / d["capacity_bytes"])
        assert d["drive_limited"] == (d["made_gbps"] > cap)
        # The drive writes at most the cap, over the step and the untimed drain after it (medians:
        # a little slack).
        assert row["written_bytes"] / (row["step_time_s"] + row["wait_s"]) <= cap * 1e9 * 1.05
        assert f"{name}: the peak fell by" in text and "drive could carry" in text
        # The headline: the peak's fall, of what the drive could take before the peak.
        steps = row["steps"]
        fall = statistics.median(s["unique"] - s["peak_saved"] for s in steps)
        assert d["peak_fall_bytes"] == fall
        possible = min(cap * 1e9 * d["forward_ref_s"], statistics.median(s["unique"] for s in steps))
        assert d["possible_bytes"] == pytest.approx(possible)
        assert d["of_possible"] == pytest.approx(fall / possible)
        assert d["possible_in_time_bytes"] <= d["possible_bytes"]
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
                # Every byte of the checkpoints is accounted for: written to the drive, kept (the
                # peak rule: a write that would end after forward), or kept by adaptive keep (its
                # write had not begun when backward did). The writes in flight are waited for first:
                # on a loaded machine none had finished when backward ended (CI, 2026-11-29).
                rpo.off.wait()
                s = rpo.off.stats()
                assert s.written_bytes + s.kept_bytes + s.adaptive_keep_bytes == s.unique_bytes > 0
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
    # Note [one peak saved for every mode]: the memory step's, not the timed steps' (whose worst was 7).
    assert off["peak_saved_bytes"] == 1 and off["peak_saved_ratio"] == pytest.approx(0.1)
    assert off["peak_saved_bytes_per_step"] == [5, 7, 6]
    assert off["peak_rss_ratio"] == pytest.approx(0.2)
    d = off["drive"]
    # Write at the limit (0.5 < 2.0 raw), read at the raw drive (0.4 < 0.5).
    assert (d["write_gbps"], d["read_gbps"]) == (0.5, 0.4)
    assert d["capacity_bytes"] == pytest.approx(min(0.5 * 1.0, 0.4 * 1.1) * 1e9)
    assert d["moved_share"] == pytest.approx(300e6 / 0.44e9)
    # 2 GB of activations in baseline's 1.0 s forward: faster than the drive writes.
    assert d["made_gbps"] == pytest.approx(2.0) and d["made_per"] == "baseline" and d["drive_limited"]
    # The peak's fall: unique - peak per step, the median; of min(limit x baseline's forward, saved).
    assert d["peak_fall_bytes"] == 2e9 - 6 and d["possible_bytes"] == pytest.approx(0.5e9)
    assert d["of_possible"] == pytest.approx((2e9 - 6) / 0.5e9) and d["forward_ref_s"] == 1.0


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


def test_a_path_not_made_yet_is_on_its_parents_device(tmp_path):
    """``--path`` the Offloader would make: the cgroup looks at the device it will be made on
    (it raised FileNotFoundError before the run began, 2026-11-28)."""
    assert drive.blkio_device(str(tmp_path / "not" / "yet")) == drive.blkio_device(str(tmp_path))


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


def test_device_option_and_its_errors(tmp_path, capsys, monkeypatch):
    ns = command._parser().parse_args(["--quick"])
    assert ns.device == "auto" and ns.dtype is None  # auto: CUDA where available; dtype follows the device
    args = command.args_from_cli(command._parser().parse_args(["--quick", "--device", "cuda:1"]))
    assert args.device == "cuda:1" and args.dtype is None
    assert runner.BenchArgs(model=GPTConfig(), batch=1, steps=1).device == "cpu"  # the library's default
    assert _device.resolve_device("cpu") == torch.device("cpu")
    assert runner.default_dtype(torch.device("cuda", 0)) == "bfloat16"
    assert runner.default_dtype(torch.device("cpu")) == "float32"
    monkeypatch.setattr(runner, "probe", lambda *a, **k: pytest.fail("the drive was probed"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _device.resolve_device("auto") == torch.device("cpu")
    nvme = tmp_path / "nvme"
    # --device cuda without CUDA: one line naming the problem and the fix, before any work.
    monkeypatch.setattr(torch.version, "cuda", None)
    assert bench.main(["--quick", "--device", "cuda", "--path", str(nvme)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "built without CUDA" in err and "use --device cpu" in err
    monkeypatch.setattr(torch.version, "cuda", "12.4")  # a CUDA build on a machine with no GPU visible
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert bench.main(["--quick", "--device", "cuda", "--path", str(nvme)]) == 2
    err = capsys.readouterr().err
    assert "torch.cuda.is_available() is False" in err and "CUDA_VISIBLE_DEVICES=''" in err
    assert "use --device cpu" in err
    assert not nvme.exists()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"has 1 CUDA device\(s\), cuda:0 to cuda:0"):
        _device.resolve_device("cuda:3")
    for bad in ("tpu", "gpu", "meta", ""):
        with pytest.raises(ValueError, match="use auto, cpu, cuda or cuda:N"):
            _device.resolve_device(bad)
    with pytest.raises(ValueError, match="dtype must be one of"):
        runner.run(runner.BenchArgs(model=GPTConfig(), batch=1, steps=1, dtype="float16"))


def test_a_gpu_gets_the_gpu_preset_and_a_model_it_cannot_hold_is_refused_first(monkeypatch, capsys):
    assert command.preset_name(True, "cuda") == "quick"  # --quick wins, and resolves nothing
    assert command.preset_name(False, "cpu") == "default"
    cpu = command.args_from_cli(command._parser().parse_args(["--device", "cpu"]))
    assert cpu.model == preset("default") and cpu.probe_bytes == 256 << 20 and cpu.steps == 3
    monkeypatch.setattr(command, "resolve_device", lambda name: torch.device("cuda", 0))
    assert command.preset_name(False, "auto") == "gpu"
    gpu = command.args_from_cli(command._parser().parse_args(["--layers", "2"]))
    assert gpu.model == preset("gpu").replace(layers=2) and gpu.probe_bytes == 1 << 30 and gpu.batch == 4
    assert gpu.steps == 10  # short GPU steps: more rounds, steadier ratios
    assert command.args_from_cli(command._parser().parse_args(["--steps", "2"])).steps == 2
    # The timed rounds hold every mode's model and AdamW state (3 x 2 bytes a parameter in bf16)
    # side by side: the GPU preset with its five modes needs more than 24 GiB, less than 40.
    gib = 1 << 30
    needed, per_mode = runner.gpu_memory_needed(preset("gpu"), 4, torch.bfloat16, 5)
    with torch.device("meta"):
        params = GPT(preset("gpu")).num_params()
    assert per_mode == 6 * params and 0.5e9 < params < 1e9
    assert 24 * gib < needed < 40 * gib, needed / gib
    assert runner.gpu_memory_needed(preset("gpu"), 4, torch.bfloat16, 1)[0] < needed - 3 * per_mode
    # Refused before any work (no probe, no child), naming the sizes and what to change.
    monkeypatch.setattr(runner, "_check", lambda args: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (20 * gib, 24 * gib))
    monkeypatch.setattr(runner, "probe", lambda *a, **k: pytest.fail("the drive was probed"))
    assert bench.main(["--device", "cuda", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "keeps all 5 modes' models on cuda:0 side by side" in err and "20.0 GiB is free" in err
    assert "pass fewer --modes" in err and err.count("\n") == 1


def test_gpu_clock_and_memory_calls_in_order(monkeypatch):
    """Notes [timing a GPU step] and [peak device memory per step], against a recording stand-in
    for torch.cuda (the real calls run in tests/gpu/test_gpu_bench.py)."""
    calls = []
    dev = torch.device("cuda", 1)

    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.t = None

        def record(self, stream):
            calls.append(("record", stream))
            self.t = len(calls)

        def elapsed_time(self, end):
            return 1000.0 * (end.t - self.t)  # milliseconds

    fake = {"Event": Event, "current_stream": lambda d: f"stream of {d}",
            "synchronize": lambda d: calls.append(("synchronize", d)),
            "reset_peak_memory_stats": lambda d: calls.append(("reset_peak_memory_stats", d)),
            "reset_peak_host_memory_stats": lambda: calls.append(("reset_peak_host_memory_stats",)),
            "memory_allocated": lambda d: calls.append(("memory_allocated", d)) or 100,
            "max_memory_allocated": lambda d: calls.append(("max_memory_allocated", d)) or 300,
            "host_memory_stats": lambda: calls.append(("host_memory_stats",)) or {"active_bytes.peak": 7}}
    for name, value in fake.items():
        monkeypatch.setattr(torch.cuda, name, value, raising=False)
    marks = _device.Marks(dev)
    marks.mark("start")
    marks.mark("forward_end")
    assert calls == [("record", "stream of cuda:1")] * 2 and marks.seconds("start", "forward_end") == 1.0
    calls.clear()
    assert _device.reset_memory_peaks(dev) == 100
    assert calls == [("synchronize", dev), ("reset_peak_memory_stats", dev), ("reset_peak_host_memory_stats",),
                     ("memory_allocated", dev)]
    calls.clear()
    assert _device.memory_peaks(dev) == {"max_memory_allocated_bytes": 300, "pinned_host_peak_bytes": 7}
    assert calls[0] == ("synchronize", dev) and ("max_memory_allocated", dev) in calls
    cpu = torch.device("cpu")
    calls.clear()
    assert _device.reset_memory_peaks(cpu) is None and _device.memory_peaks(cpu)["max_memory_allocated_bytes"] is None
    _device.synchronize(cpu)
    assert calls == []


def test_save_on_cpu_on_the_cpu_is_exact_and_copies_nothing(tmp_path):
    cfg = GPTConfig(vocab=64, seq=32, layers=3, hidden=32, heads=4)
    torch.manual_seed(0)
    ref = GPT(cfg)
    base = modes.Mode("baseline", copy.deepcopy(ref))
    soc = modes.Mode("save_on_cpu", copy.deepcopy(ref))
    assert soc.pin_memory is False and soc.off is None
    hooks = soc.hooks()
    assert isinstance(hooks, torch.autograd.graph.save_on_cpu)
    tokens = torch.randint(0, cfg.vocab, (2, cfg.seq))
    for _ in range(2):
        assert torch.equal(base.forward_backward(tokens, tokens), soc.forward_backward(tokens, tokens))
        for a, b in zip(base.model.parameters(), soc.model.parameters()):
            assert torch.equal(a.grad, b.grad)
            assert torch.equal(a, b)  # after the optimizer step too
    # Its memory step counts what its hooks keep (on the CPU: the tensors themselves), as baseline's.
    sampler = _measure.RssSampler()
    peaks = [m.measure_step(tokens, tokens, 0, sampler)[0] for m in (base, soc)]
    sampler.close()
    assert peaks[0] == peaks[1] > 0
    step = soc.timed_step(tokens, tokens)
    assert step.seconds > 0 and step.forward > 0 and step.backward > 0 and step.written == 0


def test_saved_meter_counts_what_inner_hooks_keep_on_the_device():
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 16)
    x = torch.randn(8, 16, requires_grad=True)
    expected = None
    for inner, counted in ((None, True), (torch.autograd.graph.save_on_cpu(), True),
                           # packs into plain Python lists: nothing stays in tensor memory
                           (torch.autograd.graph.saved_tensors_hooks(
                               lambda t: (t.dtype, t.shape, t.tolist()),
                               lambda p: torch.tensor(p[2], dtype=p[0]).reshape(p[1])), False)):
        meter = _measure.SavedMeter(lin, inner=inner)
        with meter:
            y = (lin(x) * 2).sum()
        y.backward()
        grad = x.grad.clone()
        x.grad = None
        assert (meter.peak > 0) == counted and meter.bytes == 0
        expected = grad if expected is None else expected
        assert torch.equal(grad, expected)


def test_gpu_table_and_json_fields_from_a_gpu_result():
    """The GPU table from a GPU-shaped result (what the child and the timed steps report there)."""
    S = modes.Step
    steps = {name: [S(2.0, 1.0, 1.0, 2.5), S(2.2, 1.1, 1.1, 2.4)] for name in ("baseline", "recompute", "save_on_cpu")}
    steps["offload"] = [S(2.1, 1.0, 1.1, 2.5, peak_saved=40, written=300e6, read=300e6, unique=2e9)] * 2
    gib = 1 << 30

    def mem(peak_saved, max_alloc, pinned):
        return {"peak_saved_bytes": peak_saved, "rss_growth_bytes": 1 << 20, "max_memory_allocated_bytes": max_alloc,
                "memory_allocated_start_bytes": gib, "pinned_host_peak_bytes": pinned}

    memory = {"baseline": mem(100, 5 * gib, 0), "recompute": mem(20, 2 * gib, 0),
              "save_on_cpu": mem(0, 1.5 * gib, 4 * gib), "offload": mem(0, 4 * gib, 64 << 20), "block_bytes": 0}
    drive_info = {"paths": ["/nvme"], "write_gbps": 6.0, "read_gbps": 7.0, "limit": None,
                  "probe": [{"direct_io": True, "fs_type": "ext4"}], "warnings": []}
    modes_out = runner._summarize(steps, memory, drive_info, None)
    off = modes_out["offload"]
    assert off["max_memory_allocated_bytes"] == 4 * gib and off["max_memory_allocated_ratio"] == pytest.approx(0.8)
    assert off["vs"]["save_on_cpu"]["max_memory_allocated_ratio"] == pytest.approx(4 / 1.5)
    assert off["vs"]["recompute"]["step_time_ratio"] == pytest.approx(statistics.median([2.1 / 2.0, 2.1 / 2.2]))
    assert off["drive"]["raw_write_gbps"] == 6.0 and off["drive"]["limit_gbps"] is None
    result = {"machine": {"cpu": "x", "cpus": 16, "torch": "2.13.0", "date": "today", "device": "cuda:0",
                          "gpu": "NVIDIA H100", "gpu_memory_bytes": 80 * gib, "cuda": "12.8"},
              "model": {"layers": 4, "hidden": 128, "heads": 4, "seq": 128, "vocab": 512, "params": 1e6, "batch": 8,
                        "dtype": "bfloat16", "device": "cuda:0", "steps": 2},
              "input": {"backend": "torch"}, "drive": drive_info,
              "offload": {"offload": {"backend": "posix: /nvme (O_DIRECT)"}},
              "save_on_cpu": {"pin_memory": True, "note": "saved tensors are copied to pinned host memory and back"},
              "modes": modes_out}
    text = bench.format_table(result)
    assert "gpu: NVIDIA H100 (cuda:0, 80.0 GiB), CUDA 12.8" in text
    assert "save_on_cpu: torch.autograd.graph.save_on_cpu(pin_memory=True)" in text
    head = next(line for line in text.splitlines() if line.startswith("mode "))
    assert "max alloc" in head and "pinned host" in head and "peak RSS+" not in head
    offload_row = next(line for line in text.splitlines() if line.startswith("offload   "))
    assert "4.0 GiB" in offload_row and "x0.80" in offload_row and "64.0 MiB" in offload_row
    assert "save_on_cpu max alloc" in text and "x2.67" in text
    assert "offload: the peak fell by" in text and "drive could carry" in text
    assert "  achieved write 0.14, read 0.14 GB/s over the step; the drive's raw write 6.00, read 7.00" in text
    assert "torch.cuda.max_memory_allocated" in text
    spread = next(line for line in text.splitlines() if line.startswith("vs base per round"))
    ratios = modes_out["offload"]["step_time_ratios"]
    assert f"offload x{min(ratios):.2f}-{max(ratios):.2f}" in spread and f"over {len(ratios)} rounds" in spread


def test_plot_without_matplotlib_is_one_clear_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    rc = bench.main(["--quick", "--plot", str(tmp_path / "x.png")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "pip install 'ssdtrain[plot]'" in err


def test_probe_missing_reports_none(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ssdtrain.tools.probe", None)
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
    """64 MiB of pages that cannot have been resident before: a fresh anonymous mapping, each
    page written. (A fresh 64 MiB tensor need not grow RSS: the allocator may hand back pages
    that earlier tests left resident; in a full run it grew 68 KiB.) No garbage collection in
    between frees memory of earlier tests."""
    sampler = _measure.RssSampler()
    if not sampler.available:
        pytest.skip("no /proc/self/statm")
    gc.collect()
    gc.disable()
    region = mmap.mmap(-1, 64 << 20)
    try:
        sampler.start()
        for offset in range(0, len(region), mmap.PAGESIZE):
            region[offset] = 1  # touched: resident
        growth = sampler.stop()
    finally:
        gc.enable()
        sampler.close()
        region.close()
    assert growth >= 48 << 20


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
    module = load_benchmark("step_time")
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


def test_peak_benchmark_smoke(tmp_path, capsys):
    """benchmarks/peak.py at the tiny size, one throttled run: so that it cannot rot."""
    module = load_benchmark("peak")
    out = tmp_path / "peak.json"
    rc = module.main(["--quick", "--rates", "100", "--kinds", "checkpointed", "--no-unthrottled", "--steps", "1",
                      "--batch", "2", "--throttle", "backend", "--path", str(tmp_path / "nvme"), "--json", str(out)])
    assert rc == 0
    assert "100 MB/s checkpointed: step x" in capsys.readouterr().out
    fig = json.loads(out.read_text())["rows"][0]["figures"]
    assert fig["possible_bytes"] == pytest.approx(min(100e6 * fig["reference_forward_s"], fig["unique_bytes"]))
    assert fig["fall_bytes"] <= fig["unique_bytes"] and 0 < fig["peak_share"] <= 1


def test_pack_cost_benchmark_smoke(tmp_path, capsys):
    """benchmarks/pack_cost.py at a tiny size: each path is the one it names, and a save kept at
    once makes fewer calls than one copied to the tier in pure Python (so that the benchmark cannot
    rot, and the cheap path stays cheap); the compiled pack, where built, fewer than pure Python."""
    from ssdtrain.engine import hooks
    from ssdtrain.engine import offloader as offloader_mod

    module = load_benchmark("pack_cost")
    out = tmp_path / "pack.json"
    before = offloader_mod._TIER_DEVICES
    assert module.main(["--layers", "2", "--steps", "2", "--rounds", "1", "--json", str(out)]) == 0
    assert offloader_mod._TIER_DEVICES == before  # the tier on CPU tensors only while it ran
    printed = capsys.readouterr().out
    assert "fwd +us/save" in printed and "sleeps a step" in printed
    rows = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
    # Note [copies are made where they are handed over]: the tier's copies wake no thread; its copy threads do
    assert rows["identity"]["sleeps_per_step"] >= 0 and rows["tier-threads"]["sleeps_per_step"] > 0
    assert rows["tier-threads"]["host_copied_bytes"] > 0 and rows["tier-threads"]["written_bytes"] > 0
    # the split of all threads' time: the training thread's share is a thread's CPU time (the tier's
    # all of it, up to the two clocks' noise; with its copy threads, less)
    tier, threads = rows["tier"], rows["tier-threads"]
    assert "the training thread +" in printed and 0 < tier["step_training_thread_ms"] <= 1.02 * tier["step_all_threads_ms"]
    assert 0 < threads["step_training_thread_ms"] < threads["step_all_threads_ms"]
    assert rows["tier"]["host_copied_bytes"] > 0 and rows["tier"]["written_bytes"] > 0
    assert rows["drive"]["host_copied_bytes"] == 0 and rows["drive"]["written_bytes"] > 0
    assert rows["kept"]["written_bytes"] == 0 and rows["kept"]["kept_bytes"] > 0
    for mode in ("tier", "drive", "kept", "tier-python", "kept-python"):
        assert rows[mode]["saves"] > 0 and rows[mode]["pack_us"] > 0 and rows[mode]["pack_calls"] > 0
    assert rows["kept-python"]["pack_calls"] < rows["tier-python"]["pack_calls"]  # pure Python's pack
    if hooks._native_pack is not None:  # the compiled pack takes a tier join's calls out of Python
        assert rows["tier"]["pack_calls"] < rows["tier-python"]["pack_calls"] - 5


def test_copy_issue_cost_benchmark_smoke(tmp_path, capsys):
    """benchmarks/investigations/copy_issue_cost.py on the CPU (the harness; the ways that need CUDA are left
    out): a loop beside a copying thread, per launch and per copy, in its JSON."""
    module = load_benchmark("investigations/copy_issue_cost")
    out = tmp_path / "cost.json"
    assert module.main(["--device", "cpu", "--copies", "20", "--mib", "0.25", "--launches", "2000", "--rounds", "1",
                        "--json", str(out)]) == 0
    assert "extra us per copy issued" in capsys.readouterr().out
    rows = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"alone", "torch"}
    assert rows["alone"]["loop_us_per_launch"] > 0 and rows["torch"]["thread_us_per_copy"] > 0
    assert rows["alone"]["extra_us_per_copy"] is None and rows["torch"]["extra_us_per_copy"] is not None


def test_spy_summary_counts_each_threads_own_and_inclusive_samples(tmp_path, capsys):
    """benchmarks/investigations/spy_summary.py on py-spy's raw format: samples per thread, busiest first; a
    sample's own frame is its last; a frame on a stack twice (recursion) counts once per sample;
    lines that are not samples are skipped."""
    module = load_benchmark("investigations/spy_summary")
    raw = tmp_path / "spy.txt"
    raw.write_text(
        'process 7:"python x.py";thread (0x1): MainThread;main (/w/x.py:3);f (/w/m.py:9);f (/w/m.py:9);'
        "addmm (libtorch_cuda.so) 6\n"
        'process 7:"python x.py";thread (0x1): MainThread;main (/w/x.py:3);wait (/w/q.py:1) 2\n'
        'process 7:"python x.py";thread (0x2);run (/w/tier.py:40) 3\n'
        "py-spy> not a sample\n")
    assert module.main([str(raw), "--top", "5"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split() == ["8", "samples", "thread", "(0x1):", "MainThread"]
    assert lines[1].split() == ["3", "samples", "thread", "(0x2)"]
    main_own = out.split("MainThread: 8 samples; own")[1].split("===")[0]
    assert "6  75.0%  addmm libtorch_cuda.so" in main_own and "2  25.0%  wait q.py:1" in main_own
    main_stack = out.split("MainThread: on the stack (inclusive)")[1].split("===")[0]
    assert "8 100.0%  main x.py:3" in main_stack and "6  75.0%  f m.py:9" in main_stack
