"""``ssdtrain bench --device cuda`` on a GPU: the steps' timing, and a tiny bench end to end with
its GPU figures (``torch.cuda.max_memory_allocated`` per mode, pinned host memory, the drive)."""

from __future__ import annotations

import json

import pytest
import torch

from ssdtrain import bench
from ssdtrain.bench import _device, modes, runner
from ssdtrain.bench.models import GPT, GPTConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

MiB = 1 << 20


def test_auto_is_the_gpu_and_bfloat16():
    dev = _device.resolve_device("auto")
    assert dev == torch.device("cuda", torch.cuda.current_device())
    assert runner.default_dtype(dev) == "bfloat16"
    assert _device.device_info(dev)["gpu"] == torch.cuda.get_device_name(dev)


def test_timed_step_splits_a_synchronized_step_by_events():
    # Note [timing a GPU step]: the events lie between the two synchronizes, so forward and
    # backward fit in the step's host time (which adds the optimizer step).
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=512, seq=128, layers=2, hidden=128, heads=4)).to("cuda", torch.bfloat16)
    mode = modes.Mode("save_on_cpu", model)
    assert mode.device.type == "cuda" and mode.pin_memory
    tokens = torch.randint(0, 512, (4, 128), device="cuda")
    for _ in range(3):
        step = mode.timed_step(tokens, tokens)
        assert step.forward > 0 and step.backward > 0
        assert step.forward + step.backward <= step.seconds + 1e-4
        assert step.loss == step.loss  # not NaN


def _bench(tmp_path, capsys, *extra: str) -> tuple[str, dict]:
    out = tmp_path / "bench.json"
    rc = bench.main(["--quick", "--device", "cuda", "--layers", "8", "--steps", "2", "--data", "torch",
                     "--probe-size", "16MiB", "--path", str(tmp_path / "nvme"), "--work-dir", str(tmp_path / "work"),
                     "--json", str(out), "--no-progress", *extra])
    text = capsys.readouterr().out
    assert rc == 0, text
    return text, json.loads(out.read_text())


# backend "auto": what a GPU user gets (kvikio with GPUDirect Storage, else posix) on this
# machine's disk, as it is and throttled in the backend (--drive-gbps). "memory": a store that is
# never slow, so that what offloading saves at the step's peak does not depend on the disk lent
# with the GPU (memory saved is what the store carries during forward: on a slow disk, next to
# nothing at --quick size).
@pytest.mark.parametrize("backend, gbps", [("auto", None), ("auto", 0.5), ("memory", None)],
                         ids=["auto", "auto-throttled", "memory"])
def test_quick_bench_on_the_gpu(backend, gbps, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SSDTRAIN_BACKEND", backend)  # the offloaders' default, here and in the child
    throttle = ("--drive-gbps", str(gbps), "--throttle", "backend") if gbps else ()
    text, result = _bench(tmp_path, capsys, *throttle)
    dev = f"cuda:{torch.cuda.current_device()}"
    assert result["model"]["device"] == dev and result["model"]["dtype"] == "bfloat16"
    assert result["machine"]["gpu"] == torch.cuda.get_device_name()
    assert f"gpu: {torch.cuda.get_device_name()} ({dev}" in text and "bfloat16, cuda:" in text
    head = next(line for line in text.splitlines() if line.startswith("mode "))
    assert "max alloc" in head and "pinned host" in head and "peak RSS+" not in head
    ms = result["modes"]
    assert list(ms) == list(bench.MODES)
    for name, row in ms.items():
        assert f"\n{name} " in text
        assert row["step_time_s"] > 0 and row["forward_s"] > 0 and row["backward_s"] > 0, name
        # Each mode alone in the child: weights, optimizer state and batch at the start, then more.
        assert row["max_memory_allocated_bytes"] > row["memory_allocated_start_bytes"] > 0, name
    base, rec, off, rpo, soc = (ms[m] for m in ("baseline", "recompute", "offload", "recompute+offload", "save_on_cpu"))
    assert base["max_memory_allocated_ratio"] == 1.0 and base["written_bytes"] == base["read_bytes"] == 0
    # Checkpointing and save_on_cpu hold far less on the device than baseline, whatever the drive.
    assert rec["max_memory_allocated_bytes"] < base["max_memory_allocated_bytes"]
    assert soc["max_memory_allocated_bytes"] < base["max_memory_allocated_bytes"]
    # save_on_cpu(pin_memory=True) keeps no saved tensor on the GPU, all of them in pinned host memory.
    assert result["save_on_cpu"]["pin_memory"] is True and "save_on_cpu(pin_memory=True)" in text
    assert soc["peak_saved_bytes"] == 0 and soc["written_bytes"] == 0
    if soc["pinned_host_peak_bytes"] is not None:  # torch.cuda.host_memory_stats (torch >= 2.7)
        assert soc["pinned_host_peak_bytes"] >= base["peak_saved_bytes"] > 0
    # The offload modes wrote to the store, read no more than they wrote, and left nothing behind.
    for name, row in (("offload", off), ("recompute+offload", rpo)):
        assert result["offload"][name]["written_bytes_all_steps"] > 0, name
        assert 0 <= row["read_bytes"] <= row["written_bytes"]
        assert row["max_memory_allocated_bytes"] > 0 and row["stall_s"] >= 0
        assert set(row["vs"]) == {"baseline", "recompute", "save_on_cpu"}
        assert row["vs"]["save_on_cpu"]["max_memory_allocated_ratio"] > 0
        assert row["drive"]["raw_write_gbps"] == result["drive"]["write_gbps"]
        assert f"{name}: drive could carry" in text or f"{name}: moved" in text
        if gbps:
            assert f"throttled to write {gbps:g} GB/s" in result["offload"][name]["backend"]
            assert row["drive"]["limit_gbps"] == gbps and row["drive"]["write_gbps"] <= gbps
            # The drive wrote at most the limit, over the step and the untimed drain after it.
            assert row["written_bytes"] / (row["step_time_s"] + row["wait_s"]) <= gbps * 1e9 * 1.05
    assert "  achieved write" in text
    assert not list((tmp_path / "nvme").rglob("*"))
    if backend == "memory":
        assert "memory" in result["offload"]["offload"]["backend"]
        assert off["written_bytes"] > 0
    # Reading back never raises the peak above what was resident when backward began (a little
    # slack: what the allocator rounds, and the store's own buffers). That offloading lowers the
    # peak is not asserted: --quick's forward takes a few milliseconds on an H100, too short for
    # even host memory to take much, and backward's read-ahead brings the first of it back at
    # once (measured 2026-11-24, memory store: 16 of 35 MiB written per step, the peak of saved
    # bytes unchanged). The peak ratios are the bench's figures, on its full-size model.
    assert off["max_memory_allocated_bytes"] <= 1.02 * base["max_memory_allocated_bytes"] + MiB
    assert off["peak_saved_bytes"] <= base["peak_saved_bytes"]
