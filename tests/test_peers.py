"""benchmarks/peers.py on the CPU: a tiny random Llama, each mode in its own process, one round.

What it checks: every mode asked for has a row; those that ran have a step time, tokens per
second, a memory figure and the bytes moved; ssdtrain's gradients are ``torch.equal`` to HF
checkpointing's (same weights, same tokens, each in its own process); and a peer that cannot run
here (not installed, or failing on the CPU) is reported with its reason, not dropped. The timings
on a loaded 2-core machine mean nothing and are not checked.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time

import pytest
from _benchmarks import load_benchmark

pytest.importorskip("transformers")


peers = load_benchmark("peers")

# Workers that run here, and peers whose packages the test environment lacks (reported at once,
# no process): torchtune, Unsloth. hf-ckpt-offload and deepspeed-offload run and fail on the CPU
# (their reasons: test_known_failures_on_the_cpu_are_explained); each worker costs its imports
# (about 10 s on a loaded 2-core machine), so they are left out here.
MODES = ["hf-ckpt", "ssdtrain", "torchtune", "unsloth"]
if importlib.util.find_spec("deepspeed") is not None:
    MODES.insert(2, "deepspeed-hf")  # imports here; offloads nothing on the CPU accelerator


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("peers")
    out = tmp / "peers.json"
    t0 = time.perf_counter()
    rc = peers.main(["--shape", "tiny", "--device", "cpu", "--rounds", "1", "--steps", "1", "--warmup", "1",
                     "--modes", ",".join(MODES), "--path", str(tmp / "act"), "--log-dir", str(tmp / "logs"),
                     "--timeout", "240", "--json", str(out), "--quiet"])
    seconds = time.perf_counter() - t0
    assert rc == 0
    return json.loads(out.read_text()), seconds


def test_every_mode_has_a_row(run, capsys):
    result, seconds = run
    modes = result["modes"]
    assert list(modes) == MODES, "a mode asked for is missing from the result"
    for m in ("hf-ckpt", "ssdtrain"):
        r = modes[m]
        assert r["status"] == "ran", r
        assert r["step_s"] > 0 and r["tokens_per_s"] > 0
        assert r["peak_bytes"] is not None and r["rss_bytes"] > 0
        assert r["versions"]["torch"] and r["versions"]["transformers"]
    assert modes["ssdtrain"]["versions"]["ssdtrain"]
    assert modes["ssdtrain"]["moved_how"] == "ssdtrain stats"
    assert modes["ssdtrain"]["moved_bytes"] > 0  # the checkpointed layer inputs left for files
    assert modes["hf-ckpt"]["moved_bytes"] == 0
    text = peers.format_table(result)
    for m in MODES:
        assert m in text
    print(f"peers on the CPU: {seconds:.1f} s\n{text}")


def test_ssdtrain_gradients_equal_hf_checkpointing(run):
    result, _ = run
    g = result["grads"]["ssdtrain"]
    assert g["equal"] is True and g["max_abs_diff"] == 0.0, g
    if "deepspeed-hf" in MODES and result["modes"]["deepspeed-hf"]["status"] == "ran":
        assert result["grads"]["deepspeed-hf"]["equal"] is True


def test_unavailable_peers_say_why(run):
    result, _ = run
    modes = result["modes"]
    for m in ("torchtune", "unsloth"):
        r = modes[m]
        if r["status"] == "ran":  # installed and running here: nothing to report
            continue
        assert r["status"] in ("unavailable", "failed")
        assert r["reason"] and len(r["reason"]) > 10, r
    if importlib.util.find_spec("torchtune") is None:
        assert "torchtune is not installed" in modes["torchtune"]["reason"]


def test_a_worker_says_why_it_cannot_run(tmp_path):
    """The worker's own refusal, through the pipe (no torch imported: the package check comes first)."""
    if importlib.util.find_spec("unsloth_zoo") is not None:
        pytest.skip("unsloth_zoo is installed here")
    args = argparse.Namespace(shape="tiny", seq=16, batch=1, device="cpu", dtype="float32", seed=0, lora=0,
                              loss_chunk=0, tile_tokens=0, path=None, threads=1,
                              deterministic=False)
    proc = peers.Proc(peers.make_spec(args, "unsloth"), str(tmp_path), "unsloth")
    try:
        msg = proc.recv(120)
    finally:
        proc.quit()
    assert msg["status"] == "unavailable" and "unsloth_zoo is not installed" in msg["reason"], msg


def test_known_failures_on_the_cpu_are_explained():
    hint = peers._hint({"mode": "hf-ckpt-offload", "device": "cpu"},
                       RuntimeError("pin_memory=True requires a CUDA or other accelerator backend"))
    assert "CPU-only torch" in hint
    assert "cpu_checkpointing" in peers._hint({"mode": "deepspeed-offload", "device": "cpu"}, IndexError("x"))
    assert peers._hint({"mode": "ssdtrain", "device": "cpu"}, RuntimeError("x")) == ""


def test_precheck_and_budget_parsing():
    assert peers.precheck("hf-ckpt") is None
    assert peers.parse_bytes("6") == 6 << 30 and peers.parse_bytes("512MiB") == 512 << 20
    assert os.path.basename(peers.__file__) == "peers.py"
