"""ssdtrain.integrations.megatron: the --ssdtrain flags and the patch of Megatron-Core's schedules.

The schedule tests train a tiny GPTModel with real Megatron-Core on the CPU (gloo), in
subprocesses (``tests/_megatron_worker.py``, through the test-only ``tests/_megatron_shim.py``),
and require bit-identical losses and gradients with and without the patch. Tests that need
Megatron-Core skip when it is not installed (``pip install megatron-core==0.16.1``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

import ssdtrain
from _torchrun import run_group, torchrun
from ssdtrain.config import field_names
from ssdtrain.integrations import megatron as ssd_megatron

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "_megatron_worker.py")


@pytest.fixture
def schedules():
    """megatron.core.pipeline_parallel.schedules (its import warns that Apex is missing)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pytest.importorskip("megatron.core")
        from megatron.core.pipeline_parallel import schedules
    yield schedules
    active = getattr(schedules.forward_step, "__ssdtrain_patch__", None)
    if active is not None:  # a failed test must not leave Megatron patched for the next one
        active.unpatch()


def parse(argv):
    return ssd_megatron.add_arguments(argparse.ArgumentParser()).parse_args(argv)


# -- flags (no Megatron needed) ---------------------------------------------------------------------
def test_import_is_lean():
    code = ("import sys, ssdtrain.integrations.megatron; "
            "sys.exit(any(m == 'megatron' or m.startswith('megatron.') for m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


def test_add_arguments_returns_the_parser_and_adds_nothing_by_default():
    parser = argparse.ArgumentParser()
    assert ssd_megatron.add_arguments(parser) is parser
    args = parser.parse_args([])
    assert args.ssdtrain is False
    assert ssd_megatron.patch_from_args(args) is None  # nothing happens without --ssdtrain


def test_every_flag_is_a_config_field():
    flags = {name for name, _ in ssd_megatron._FLAGS}
    assert flags <= set(field_names())
    assert set(field_names()) - flags == {"create_path"}


def test_flags_become_the_config(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    args = parse(["--ssdtrain", "--ssdtrain-path", str(a), str(b), "--ssdtrain-min-bytes", "64KiB",
                  "--ssdtrain-keep-last-layers", "2", "--ssdtrain-backend", "memory",
                  "--ssdtrain-prefetch-bytes", "32MiB", "--ssdtrain-when-full", "keep", "--ssdtrain-verify",
                  "--ssdtrain-io-threads", "3", "--ssdtrain-direct-io", "off", "--ssdtrain-host-bytes", "2GiB"])
    cfg = ssd_megatron.config_from_args(args)
    assert cfg.host_bytes == 2 << 30
    assert ssd_megatron.config_from_args(parse(["--ssdtrain", "--ssdtrain-host-bytes", "auto"])).host_bytes is None
    assert cfg.paths == (str(a), str(b))
    assert (cfg.min_bytes, cfg.keep_last_layers, cfg.backend) == (64 << 10, 2, "memory")
    assert (cfg.prefetch_bytes, cfg.when_full, cfg.verify) == (32 << 20, "keep", True)
    assert (cfg.io_threads, cfg.direct_io) == (3, False)
    # Left out: OffloadConfig's own defaults.
    default = ssdtrain.OffloadConfig()
    cfg = ssd_megatron.config_from_args(parse(["--ssdtrain"]))
    assert (cfg.min_bytes, cfg.max_inflight_bytes, cfg.verify) == (
        default.min_bytes, default.max_inflight_bytes, default.verify)


@pytest.mark.parametrize("argv", [["--ssdtrain-min-bytes", "lots"], ["--ssdtrain-backend", "tape"],
                                  ["--ssdtrain-direct-io", "maybe"]])
def test_bad_flags_are_refused_by_the_parser(argv, capsys):
    with pytest.raises(SystemExit):
        parse(argv)
    assert "ssdtrain" in capsys.readouterr().err


def test_patch_without_megatron_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "megatron.core.pipeline_parallel.schedules", None)
    with pytest.raises(ImportError, match=r"pip install 'ssdtrain\[megatron\]'"):
        ssd_megatron.patch(backend="memory")


# -- the wrappers' bookkeeping, on a stand-in schedules module -----------------------------------
class FakeSchedules:
    """Megatron's two per-micro-batch functions, reduced to what the wrappers rely on."""

    def __init__(self):
        self.forward_step = self._forward_step
        self.backward_step = self._backward_step

    @staticmethod
    def _forward_step(forward_step_func, data_iterator, model, num_microbatches, input_tensor,
                      forward_data_store, config, cp_group_size, collect_non_loss_data=False,
                      checkpoint_activations_microbatch=None, is_first_microbatch=False,
                      current_microbatch=None, vp_stage=None, is_last_stage=True):
        return forward_step_func(input_tensor), torch.tensor(0)

    @staticmethod
    def _backward_step(input_tensor, output_tensor, output_tensor_grad, model_type, config):
        output_tensor.sum().backward()
        return None


def test_forward_only_passes_leave_nothing_pending(tmp_path):
    fake = FakeSchedules()
    w = torch.randn(8, 8, requires_grad=True)
    with ssd_megatron.MegatronPatch(fake, ssdtrain.Offloader(path=str(tmp_path), backend="memory",
                                                              min_bytes=0)) as handle:
        for _ in range(3):  # outputs dropped without backward (an evaluation under grad mode)
            fake.forward_step(lambda x: (x @ w) * 2, None, None, 1, torch.randn(4, 8), [], None, 1)
        gc.collect()
        assert handle.pending() == {}
        # Unnumbered micro-batches get the lowest free number, so ids stay few.
        outs = [fake.forward_step(lambda x: torch.tanh(x @ w), None, None, 2, torch.randn(4, 8), [], None, 1)[0]
                for _ in range(2)]
        assert handle.pending() == {0: [0, 1]}
        for out in outs:
            fake.backward_step(None, out, None, None, None)
        assert handle.pending() == {}
        with torch.no_grad():  # no saves, no scope, nothing pending
            fake.forward_step(lambda x: x @ w, None, None, 1, torch.randn(4, 8), [], None, 1)
        assert handle.pending() == {} and handle.offloader.stats().microbatches.keys() == {0, 1}
    assert fake.forward_step == fake._forward_step


# -- the patch itself (Megatron-Core imported in this process) ------------------------------------
def test_patch_unpatch_restores_the_same_functions(schedules, tmp_path):
    originals = (schedules.forward_step, schedules.backward_step)
    handle = ssd_megatron.patch(path=str(tmp_path), backend="memory")
    assert isinstance(handle.offloader, ssdtrain.Offloader)
    assert schedules.forward_step is not originals[0]
    assert schedules.forward_step.__wrapped__ is originals[0]
    with pytest.raises(RuntimeError, match="already patched"):
        ssd_megatron.patch(path=str(tmp_path), backend="memory")
    handle.unpatch()
    assert (schedules.forward_step, schedules.backward_step) == originals
    assert schedules.forward_step is originals[0] and schedules.backward_step is originals[1]
    handle.unpatch()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        handle.offloader.prefetch(0)

    with ssd_megatron.patch(path=str(tmp_path), backend="memory") as h:
        assert schedules.backward_step.__wrapped__ is originals[1]
    assert not h.active
    assert schedules.forward_step is originals[0] and schedules.backward_step is originals[1]


def test_unpatch_refuses_to_drop_a_later_patch(schedules, tmp_path):
    handle = ssd_megatron.patch(path=str(tmp_path), backend="memory")
    ours = schedules.forward_step
    schedules.forward_step = lambda *a, **k: ours(*a, **k)
    try:
        with pytest.raises(RuntimeError, match="reverse order"):
            handle.unpatch()
    finally:
        schedules.forward_step = ours
    handle.unpatch()


def test_patch_from_args_through_a_real_parser(schedules, tmp_path):
    originals = (schedules.forward_step, schedules.backward_step)
    parser = ssd_megatron.add_arguments(argparse.ArgumentParser(prog="pretrain_gpt.py"))
    parser.add_argument("--num-layers", type=int)  # a host flag beside ours
    args = parser.parse_args(["--num-layers", "4", "--ssdtrain", "--ssdtrain-path", str(tmp_path),
                              "--ssdtrain-backend", "memory", "--ssdtrain-min-bytes", "0"])
    handle = ssd_megatron.patch_from_args(args)
    try:
        assert handle.offloader.config.min_bytes == 0 and handle.offloader.backend == "memory"
        assert schedules.forward_step.__wrapped__ is originals[0]
        # Megatron-LM calls model_provider once per model chunk: the same args, the same handle.
        assert ssd_megatron.patch_from_args(args) is handle
        other = parser.parse_args(["--ssdtrain", "--ssdtrain-path", str(tmp_path), "--ssdtrain-backend", "memory"])
        with pytest.raises(RuntimeError, match="already patched"):
            ssd_megatron.patch_from_args(other)
    finally:
        handle.unpatch()
    assert schedules.forward_step is originals[0] and schedules.backward_step is originals[1]


def test_keep_last_layers_needs_the_model(schedules, tmp_path):
    with pytest.raises(ValueError, match="model="):
        ssd_megatron.patch(path=str(tmp_path), backend="memory", keep_last_layers=1)
    chunks = [torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)]))
              for _ in range(2)]
    with ssd_megatron.patch(path=str(tmp_path), backend="memory", keep_last_layers=1, model=chunks) as h:
        # Both chunks' blocks, in order: the last one kept is chunk 1's last block.
        assert h.offloader._blocks == [*chunks[0][0], *chunks[1][0]]
    blocks = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(3)]))
    with ssd_megatron.patch(path=str(tmp_path), backend="memory", keep_last_layers=1, model=blocks) as h:
        assert h.offloader.config.keep_last_layers == 1
    assert getattr(schedules.forward_step, "__ssdtrain_patch__", None) is None


# -- deallocate_output_tensor vs saved references --------------------------------------------------
# Megatron hollows out a sent stage output (out.data = 1-element tensor) while its graph lives on.
# If an op saved that very output (tanh saves its result), saved-tensor hooks receive the same
# tensor object: a saved reference that holds the object, not its storage, would then see one
# element in backward and broadcast it silently. ssdtrain's entries hold the storage.
def _stage_grads(schedules, off, case):
    torch.manual_seed(0)
    x = torch.randn(64, 48, requires_grad=True)  # like a received input_tensor
    w = torch.randn(48, 48, requires_grad=True)
    grad = torch.randn(64, 48)
    scope = off.microbatch(0) if off is not None else contextlib.nullcontext()
    with scope:
        if case == "no_offload":
            with ssdtrain.no_offload():
                out = torch.tanh(x @ w)
        else:
            out = torch.tanh(x @ w)
    if off is not None and case == "written":
        off.wait()  # on storage, memory dropped: backward reads it back
    schedules.deallocate_output_tensor(out, deallocate_pipeline_outputs=True)
    assert out.numel() == 1
    if off is not None:
        off.prefetch(0)
    schedules.custom_backward(out, grad)
    return x.grad, w.grad


@pytest.mark.parametrize("case", ["written", "queued", "kept"])
def test_deallocated_output_keeps_exact_gradients(schedules, tmp_path, case):
    want = _stage_grads(schedules, None, "reference")
    off = ssdtrain.Offloader(path=str(tmp_path), backend="posix", min_bytes="1GiB" if case == "kept" else 0)
    try:
        got = _stage_grads(schedules, off, case)
        stats = off.stats()
    finally:
        off.close()
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    out_bytes = 64 * 48 * 4
    if case == "written":
        assert stats.written_bytes >= out_bytes and stats.read_bytes >= out_bytes
    if case == "kept":
        assert stats.written_bytes == 0 and stats.kept_bytes >= out_bytes


def test_deallocated_output_saved_inside_no_offload(schedules, tmp_path):
    want = _stage_grads(schedules, None, "reference")
    off = ssdtrain.Offloader(path=str(tmp_path), backend="memory", min_bytes=0)
    try:
        got = _stage_grads(schedules, off, "no_offload")
    finally:
        off.close()
    assert all(torch.equal(g, w) for g, w in zip(got, want))


# -- the three schedules, end to end (1F1B also with full recompute; no pipeline with TP 2) ----------
@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["none", "1f1b", "interleaved", "1f1b+recompute", "none+tp2"])
def test_schedule_bit_identical_with_offload(schedule, schedules, tmp_path):
    storage, out = tmp_path / "storage", tmp_path / "out"
    storage.mkdir()
    out.mkdir()
    schedule, _, extra = schedule.partition("+")
    args = [WORKER, "--schedule", schedule, "--storage", str(storage), "--out", str(out), "--timeout", "120"]
    if extra == "recompute":  # Megatron's checkpointing: each layer saves its input, the offloader takes those
        args.append("--recompute")
    if extra == "tp2":  # tensor parallelism: each layer's linears split over the 2 ranks
        args += ["--tensor-parallel", "2"]
    if schedule == "none" and not extra:
        run_group([sys.executable, *args])
    else:
        torchrun(*args)
    ranks = 1 if schedule == "none" and not extra else 2
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]
    for rep in reports:
        failed = {k: rep["notes"].get(k, "") for k, ok in rep["checks"].items() if not ok}
        assert not failed, f"rank {rep['rank']} ({schedule}): {failed}"
        # Every stage wrote its activations to its own directory, and read them back.
        assert rep["written_bytes"] > 0 and rep["read_bytes"] > 0
        assert list(rep["written_bytes_by_path"]) == [str(storage / f"rank{rep['rank']}")]
        assert rep["kept_bytes"] > 0
        assert len(rep["microbatches"]) == (8 if schedule == "interleaved" else 4)
        # A 1 MB/s drive (slow_drive_equals_plain above: exact): some went to it, and what it
        # could not take in time stayed in memory.
        slow = rep["slow_drive"]
        assert slow["written_bytes"] > 0, slow
        assert slow["budget_kept_bytes"] + slow["adaptive_keep_bytes"] > 0, slow
    assert reports[-1]["losses"], "the last stage reports the losses"
