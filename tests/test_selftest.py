"""``ssdtrain selftest`` (ssdtrain/tools/selftest.py) on this machine: the CPU checks pass, the CUDA ones
are skipped with a plain message where there is no GPU, and a broken backend is caught."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import Future

import pytest
import torch

from ssdtrain import cli
from ssdtrain.tools import selftest
from ssdtrain.config import OffloadConfig
from ssdtrain.store.memory import MemoryBackend


def test_passes_here_and_says_what_it_skipped(tmp_path, capsys):
    out_json = tmp_path / "report.json"
    rc = cli.main(["selftest", "--path", str(tmp_path), "--json", str(out_json)])
    out = capsys.readouterr().out
    assert rc == 0, out
    lines = out.splitlines()
    assert lines[0].startswith("PASS  environment") and f"torch {torch.__version__}" in lines[0]
    assert any(line.startswith("PASS  exact[posix, cpu, float32]") for line in lines)
    assert any(line.startswith("PASS  exact[memory, cpu, float32]") for line in lines)
    report = json.loads(out_json.read_text())
    assert report["summary"] == lines[-1]
    assert {c["status"] for c in report["checks"]} <= {"PASS", "SKIP"}
    if not torch.cuda.is_available():
        assert "SKIP  cuda" in out and lines[-1].endswith("no GPU: CUDA checks skipped")
    assert list(tmp_path.iterdir()) == [out_json]  # its private directory is gone


def test_a_backend_that_returns_wrong_bytes_fails_the_check(tmp_path):
    class Flipping(MemoryBackend):
        def submit_read(self, extent, dst, *, checksum=None, ready=None):
            out = Future()

            def flip(f):  # one bit of every tensor read back, before the read counts as done
                if f.exception() is not None:
                    out.set_exception(f.exception())
                    return
                dst[0] ^= 1
                out.set_result(None)

            super().submit_read(extent, dst, checksum=checksum, ready=ready).add_done_callback(flip)
            return out

    store = Flipping(OffloadConfig(path=str(tmp_path), backend="memory"))
    with pytest.raises(AssertionError, match="differs|!= "):
        selftest.exact_gradients("memory", str(tmp_path), store=store)


def test_a_failed_check_fails_the_command(tmp_path, monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise AssertionError("step 0: gradient 3 differs (max abs 0.5)")

    monkeypatch.setattr(selftest, "exact_gradients", broken)
    assert selftest.main(["--path", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "FAIL  exact[posix, cpu, float32]" in out and "gradient 3 differs" in out
    assert " failed" in out.splitlines()[-1] and "0 failed" not in out.splitlines()[-1]


def test_overlap_limit(monkeypatch):
    monkeypatch.setattr(selftest, "overlap_ratio", lambda *a, **k: (1.2, 1.0, 1.2))
    assert "x1.20" in selftest._overlap("posix", "/tmp", None, 1.0)
    monkeypatch.setattr(selftest, "overlap_ratio", lambda *a, **k: (2.5, 1.0, 2.5))
    with pytest.raises(AssertionError, match="serialises with compute"):
        selftest._overlap("posix", "/tmp", None, 1.0)


def test_a_path_that_is_not_a_directory(tmp_path, capsys):
    assert selftest.main(["--path", str(tmp_path / "missing")]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_importing_it_imports_no_torch():
    code = "import sys, ssdtrain.tools.selftest; assert 'torch' not in sys.modules; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "ok", out.stderr


def test_the_gpu_checks_it_would_run(tmp_path, monkeypatch):
    # The GPU branch's plan, with the checks themselves stubbed (no GPU here to run them).
    monkeypatch.setattr(selftest, "_environment", lambda path: (selftest.Check("environment", "PASS", "stub"), True))
    calls = []

    def exact(backend, path, *, device="cpu", dtype="float32", setup=None, **kw):
        calls.append(("exact", backend, device, dtype, setup is not None))
        return "ok"

    def overlap(backend, path, setup, seconds):
        calls.append(("overlap", backend, setup is not None))
        return "x1.01"

    monkeypatch.setattr(selftest, "exact_gradients", exact)
    monkeypatch.setattr(selftest, "_overlap", overlap)
    checks = selftest.run(str(tmp_path))
    names = [c.name for c in checks]
    kvikio = selftest._kvikio_available() is None
    # Without kvikio, one line says why its checks did not run.
    assert all(c.status == "PASS" or (not kvikio and c.name == "exact[kvikio, cuda]" and c.status == "SKIP")
               for c in checks), checks
    want = ["posix", "memory"] + (["kvikio", "kvikio compat"] if kvikio else [])
    for label in want:
        for dtype in ("float32", "bfloat16"):
            assert f"exact[{label}, cuda, {dtype}]" in names
        if label != "memory":
            assert f"overlap[{label}]" in names
    assert ("exact", "kvikio", "cuda", "bfloat16", True) in calls or not kvikio  # compat: its setup is used
    assert names[-1] == "streams"


def test_kernels_that_differ_run_to_run_make_the_check_a_skip_not_a_failure(tmp_path, monkeypatch, capsys):
    real = selftest._tiny_transformer_cls()

    class Drifting(real):  # what non-deterministic kernels amount to: each run a little different
        runs = 0

        def forward(self, x):
            Drifting.runs += 1
            return super().forward(x) + 1e-3 * Drifting.runs

    monkeypatch.setattr(selftest, "_tiny_transformer_cls", lambda: Drifting)
    with pytest.raises(selftest.Undecided, match="non-deterministic kernels"):
        selftest.exact_gradients("memory", str(tmp_path))
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert selftest.main(["--path", str(tmp_path)]) == 0  # nothing failed; nothing proven either
    out = capsys.readouterr().out
    assert "SKIP  exact[posix, cpu, float32]" in out and "exact comparison is impossible" in out
    assert "0 failed, 3 skipped" in out.splitlines()[-1]
    # The command's own process: cuBLAS set up to be bit-reproducible across streams.
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
