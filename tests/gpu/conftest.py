"""Shared pieces of the GPU tests (marker ``gpu``; every module skips without CUDA).

Run them with ``pytest -m gpu tests/gpu`` on a machine with a GPU. They use the public API
(``ssdtrain.Offloader``) and, for the races that need exact timing, a backend and the fences of
``ssdtrain.device.cuda`` directly. ``torch.cuda._sleep`` holds a stream for a chosen time, so that a
missing fence shows as wrong bytes instead of as luck.
"""

from __future__ import annotations

import contextlib
import os
import time

import _gpu
import pytest
import torch

# cuBLAS is bit-reproducible across streams only with a fixed workspace configuration (NVIDIA's
# and PyTorch's reproducibility notes); the exact tests run GEMMs on a second stream. Read when
# cuBLAS makes its first handle, so setting it here, before any test's first GEMM, is in time.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


@pytest.fixture(autouse=True)
def _drives_only(monkeypatch):
    """The GPU tests of the drive backends move CUDA tensors to the drives, not the host tier
    (on by default on a GPU): ``SSDTRAIN_HOST_BYTES=0``. Tests of the tier pass ``host_bytes``."""
    monkeypatch.setenv("SSDTRAIN_HOST_BYTES", "0")


@pytest.fixture
def backend(request):
    """``(name, setup)`` for a parameter of ``_gpu.BACKENDS`` (indirect); skips kvikio where it cannot load."""
    name, setup = request.param
    if name == "kvikio":
        why = _gpu.kvikio_missing()
        if why is not None:
            pytest.skip(why)
    return name, setup or contextlib.nullcontext


@pytest.fixture(scope="session")
def sleep():
    """``sleep(ms)``: queues a kernel that spins for about ``ms`` milliseconds on the current stream."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.cuda._sleep(1000)  # warm up
    torch.cuda.synchronize()
    cycles = 50_000_000
    start = time.perf_counter()
    torch.cuda._sleep(cycles)
    torch.cuda.synchronize()
    per_ms = cycles / max((time.perf_counter() - start) * 1000, 1e-3)

    def sleep(ms: float) -> None:
        torch.cuda._sleep(int(per_ms * ms))

    return sleep
