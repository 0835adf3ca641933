"""Runs a test's worker script on 2 (or more) ranks under torchrun (CPU, gloo) and fails the test clearly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest


def run_group(cmd: list[str], timeout: float = 240, env: dict[str, str] | None = None) -> str:
    """Runs ``cmd`` in its own process group (with ``env`` added to the environment); returns its
    output. A timeout kills the whole group (a rank that crashed leaves its peer waiting in a
    collective) and fails the test, as does a non-zero exit."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **(env or {}))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} timed out after {timeout}s:\n{out[-4000:]}")
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{out[-4000:]}"
    return out


def torchrun(worker: str, *args: str, timeout: float = 240, env: dict[str, str] | None = None, nproc: int = 2) -> str:
    """``python -m torch.distributed.run --standalone --nproc_per_node=NPROC worker *args`` (see
    :func:`run_group`)."""
    return run_group([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                      worker, *args], timeout, env)


def gloo_or_skip() -> None:
    import torch.distributed

    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
