"""``ssdtrain selftest``: does offloading work on this machine, exactly and without slowing compute?

One command to run where training will run::

    ssdtrain selftest [--path DIR] [--json FILE]

Checks, one line each (PASS, FAIL or SKIP):

* ``environment``: torch and its CUDA, the GPU, kvikio (or why not), GPUDirect Storage (or why
  not), what ``backend="auto"`` picks and why;
* ``path``: the directory offloading writes to -- file system, O_DIRECT, RAM-backed or not;
* ``exact[...]``: a small transformer (attention, layer norm, dropout with a fixed seed) trained
  two steps with and without offloading gives ``torch.equal`` gradients, for each backend that can
  run here (posix and memory on the CPU; on a GPU also kvikio, in fp32 and bf16); SKIP where
  two runs without offloading already differ (kernels that are not deterministic here);
* ``overlap[...]`` (GPU): a GEMM loop timed alone and while offloading I/O streams through the
  backend; the ratio must stay under 1.5 (Note [kvikio compat mode serialises with compute]).

Without a GPU the CPU checks run and the CUDA ones are skipped, with a line that says so; the
exit status is 0 when every check that ran passed, else 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["Check", "TinyTransformer", "Undecided", "exact_gradients", "overlap_ratio", "run", "main"]

OVERLAP_LIMIT = 1.5
"""A GEMM loop may take at most this many times as long with offloading I/O running beside it."""


class Undecided(Exception):
    """A check that cannot decide here (e.g. kernels that differ run to run): reported as SKIP."""


@dataclasses.dataclass
class Check:
    """One line of the report."""

    name: str
    status: str  # "PASS", "FAIL" or "SKIP"
    detail: str = ""
    seconds: float = 0.0


def _tiny_transformer_cls():
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self, d: int, heads: int, p: float) -> None:
            super().__init__()
            self.heads = heads
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
            self.drop = nn.Dropout(p)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
            causal = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
            att = self.drop(att.masked_fill(causal, float("-inf")).softmax(-1))
            y = (att @ v).transpose(1, 2).reshape(b, t, d)
            x = x + self.drop(self.proj(y))
            return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))

    class TinyTransformer(nn.Module):
        """A decoder in miniature, written out so that every kernel is deterministic (explicit
        attention, no fused or atomic backward): gradients with and without offloading compare
        with ``torch.equal``."""

        def __init__(self, d: int = 64, heads: int = 4, layers: int = 2, p: float = 0.1) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block(d, heads, p) for _ in range(layers))
            self.norm = nn.LayerNorm(d)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return self.norm(x)

    return TinyTransformer


def __getattr__(name: str) -> Any:
    if name == "TinyTransformer":  # built on first use: importing this module imports no torch
        return _tiny_transformer_cls()
    raise AttributeError(f"module 'ssdtrain.tools.selftest' has no attribute {name!r}")


def exact_gradients(backend: str, path: str, *, device: str = "cpu", dtype: str = "float32", steps: int = 2,
                    setup: Callable[[], Any] | None = None, **overrides: Any) -> str:
    """Trains :class:`TinyTransformer` ``steps`` times with and without an Offloader; returns
    a summary of the I/O, or raises ``AssertionError`` saying what differed.

    ``setup``, when given, is a context manager factory entered while the Offloader is made
    (e.g. kvikio's compatibility mode).
    """
    import contextlib

    import torch

    import ssdtrain

    dt = getattr(torch, dtype)
    torch.manual_seed(0)
    model = _tiny_transformer_cls()().to(device=device, dtype=dt)
    x = torch.randn(4, 32, 64, device=device, dtype=dt)

    def one_step(off) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1234)  # the same dropout masks in every run
        with off if off is not None else contextlib.nullcontext():
            loss = model(x).float().square().mean()
            if off is not None:
                # Inside the block: every write lands and backward reads it all back (after the
                # block, writes still queued are kept instead; a GPU's forward outruns them).
                off.wait()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    want = one_step(None)
    again = one_step(None)
    if not (torch.equal(want[0], again[0]) and all(torch.equal(a, b) for a, b in zip(want[1], again[1]))):
        raise Undecided("two runs without offloading already differ (non-deterministic kernels here): "
                        "exact comparison is impossible")
    with setup() if setup is not None else contextlib.nullcontext():
        off = ssdtrain.Offloader(model, path=path, backend=backend, min_bytes=0, **overrides)
    try:
        for step in range(steps):
            got = one_step(off)
            if not torch.equal(want[0], got[0]):
                raise AssertionError(f"step {step}: loss {got[0].item()} != {want[0].item()} without offloading")
            for i, (a, b) in enumerate(zip(want[1], got[1])):
                if not torch.equal(a, b):
                    raise AssertionError(f"step {step}: gradient {i} differs (max abs {(a - b).abs().max().item()})")
        off.wait()
        s = off.stats()
        if s.written_bytes <= 0 or s.read_bytes <= 0:
            raise AssertionError(f"nothing went through the drive (written {s.written_bytes}, read {s.read_bytes} "
                                 "bytes): the check would prove nothing")
        return f"{s.written_bytes / 2**20:.1f} MiB written, {s.read_bytes / 2**20:.1f} MiB read; {s.backend}"
    finally:
        off.close()


def overlap_ratio(backend: str, path: str, *, seconds: float = 1.0, nbytes: int = 256 << 20,
                  setup: Callable[[], Any] | None = None) -> tuple[float, float, float]:
    """``(ratio, alone, with_io)``: seconds of a bf16 GEMM loop on the current GPU with offloading
    I/O streaming through ``backend`` beside it, over the same loop alone.

    The I/O thread writes and reads back one CUDA tensor of ``nbytes`` again and again through
    the backend (device-to-host copies, the drive, host-to-device copies) while the main thread
    times the GEMMs on the default stream. A path that serialises with compute (a blocking stream,
    a default-stream barrier) makes the ratio grow with the I/O; one that does not leaves it near 1.
    """
    import contextlib

    import torch

    from ssdtrain.config import OffloadConfig
    from ssdtrain.store import make_backend

    dev = torch.device("cuda", torch.cuda.current_device())
    a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)

    def gemms(n: int) -> float:
        torch.cuda.synchronize(dev)
        start = time.perf_counter()
        for _ in range(n):
            a @ a
        torch.cuda.synchronize(dev)
        return time.perf_counter() - start

    gemms(3)
    per = gemms(10) / 10
    n = max(10, int(seconds / max(per, 1e-6)))
    with setup() if setup is not None else contextlib.nullcontext():
        store = make_backend(OffloadConfig(path=path, backend=backend))
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    torch.cuda.synchronize(dev)
    stop, errors = threading.Event(), []

    def stream_io() -> None:
        try:
            extent = store.allocate(nbytes)
            while not stop.is_set():
                store.submit_write(extent, src).result()
                store.submit_read(extent, dst).result()
            store.free(extent)
        except BaseException as e:  # reported by the caller
            errors.append(e)

    try:
        alone = gemms(n)
        io = threading.Thread(target=stream_io, name="ssdtrain-selftest-io", daemon=True)
        io.start()
        time.sleep(0.2)  # let the I/O get going
        with_io = gemms(n)
        stop.set()
        io.join()
        if errors:
            raise errors[0]
        if not torch.equal(src, dst):
            raise AssertionError("the bytes read back differ from those written")
        again = gemms(n)  # the loop alone again: the ratio is against the faster of the two
    finally:
        stop.set()
        store.close()
    base = min(alone, again)
    return with_io / base, base, with_io


def _environment(path: str) -> tuple[Check, bool]:
    import torch

    from ssdtrain.config import OffloadConfig
    from ssdtrain.store import backend_choice

    parts = [f"torch {torch.__version__}"]
    cuda = torch.cuda.is_available()
    if cuda:
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        parts.append(f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s): {props.name} "
                     f"(sm_{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB)")
    else:
        parts.append(f"no GPU (torch built for CUDA {torch.version.cuda})" if torch.version.cuda
                     else "no GPU (a CPU build of torch)")
    try:
        import kvikio

        from ssdtrain.store.kvikio_backend import gds_status
    except ImportError as e:
        parts.append(f"kvikio: {e}")
    else:
        parts.append(f"kvikio {kvikio.__version__}")
        if cuda:
            gds, why = gds_status()
            parts.append(("GDS: " if gds else "no GDS: ") + why)
    name, why = backend_choice(OffloadConfig(path=path, backend="auto"))
    parts.append(f"auto backend: {name} ({why})")
    return Check("environment", "PASS", "; ".join(parts)), cuda


def _path_check(path: str) -> Check:
    from ssdtrain.store import _fs

    fs = _fs.fs_type(path)
    direct = _fs.direct_io_supported(path)
    detail = f"{path}: {fs}, " + ("O_DIRECT" if direct else "no O_DIRECT (buffered I/O through the page cache)")
    if _fs.is_ram_backed(path):
        detail += "; RAM-backed: offloading there saves no memory (use --path on the NVMe drive)"
    return Check("path", "PASS", detail)


def _kvikio_available() -> str | None:
    """``None`` when the kvikio backend can be made here, else why not."""
    try:
        import ssdtrain.store.kvikio_backend  # noqa: F401
    except ImportError as e:
        return str(e)
    return None


def _kvikio_compat():
    import kvikio
    import kvikio.defaults

    return kvikio.defaults.set("compat_mode", kvikio.CompatMode.ON)


def _timed(name: str, fn: Callable[[], str]) -> Check:
    start = time.perf_counter()
    try:
        detail = fn()
        status = "PASS"
    except AssertionError as e:
        detail, status = str(e), "FAIL"
    except Undecided as e:
        detail, status = str(e), "SKIP"
    except Exception as e:  # a check that crashes is a failed check, with its cause
        detail, status = f"{type(e).__name__}: {e}", "FAIL"
    return Check(name, status, detail, time.perf_counter() - start)


def run(path: str, *, report: Callable[[Check], None] = lambda c: None, overlap_seconds: float = 1.0) -> list[Check]:
    """Runs every check that can run here (in a private directory under ``path``); returns them."""
    checks: list[Check] = []

    def add(check: Check) -> None:
        checks.append(check)
        report(check)

    work = tempfile.mkdtemp(prefix="ssdtrain-selftest-", dir=path)
    try:
        env, cuda = _environment(work)
        add(env)
        add(_path_check(work))
        for backend in ("posix", "memory"):
            add(_timed(f"exact[{backend}, cpu, float32]", lambda b=backend: exact_gradients(b, work)))
        from ssdtrain.engine import native  # which pack ran those: Note [a compiled pack for the common save]

        from ssdtrain.device import copies  # Note [a batch of copies releases the GIL once]

        batched = "a batch with the GIL released once" if copies._compiled() else "one ctypes call a copy"
        add(Check("pack", "PASS", f"pack hook: {native.native_pack_status()}; tier copies: {batched}"))
        kvikio_why = _kvikio_available()
        backends: list[tuple[str, str, Any]] = [("posix", "posix", None), ("memory", "memory", None)]
        if kvikio_why is None:
            backends += [("kvikio", "kvikio", None), ("kvikio compat", "kvikio", _kvikio_compat)]
        if not cuda:
            add(Check("cuda", "SKIP", "no GPU: CUDA checks skipped"))
            return checks
        for label, backend, setup in backends:
            for dtype in ("float32", "bfloat16"):
                # host_bytes=0: the drive backend's own CUDA path, not the host tier in front of it
                add(_timed(f"exact[{label}, cuda, {dtype}]", lambda b=backend, d=dtype, s=setup: exact_gradients(
                    b, work, device="cuda", dtype=d, setup=s, host_bytes=0)))
        for dtype in ("float32", "bfloat16"):
            add(_timed(f"exact[host tier, cuda, {dtype}]", lambda d=dtype: exact_gradients(
                "posix", work, device="cuda", dtype=d, host_bytes="256MiB")))
            add(_timed(f"exact[host tier full, cuda, {dtype}]", lambda d=dtype: exact_gradients(
                "posix", work, device="cuda", dtype=d, host_bytes="64KiB")))
        if kvikio_why is not None:
            add(Check("exact[kvikio, cuda]", "SKIP", kvikio_why))
        for label, backend, setup in backends:
            if backend == "memory":
                continue  # no drive: nothing of the drive's I/O path to measure
            add(_timed(f"overlap[{label}]", lambda b=backend, s=setup: _overlap(b, work, s, overlap_seconds)))
        from ssdtrain.device import cuda as device

        add(Check("streams", "PASS", f"I/O side streams: {device.stream_source()}"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return checks


def _overlap(backend: str, path: str, setup, seconds: float) -> str:
    ratio, alone, with_io = overlap_ratio(backend, path, seconds=seconds, setup=setup)
    text = f"GEMM loop {alone:.2f} s alone, {with_io:.2f} s beside offloading I/O: x{ratio:.2f}"
    if not ratio < OVERLAP_LIMIT:
        raise AssertionError(f"{text} (limit x{OVERLAP_LIMIT}): the I/O path serialises with compute")
    return text


def _summary(checks: list[Check]) -> str:
    count = {s: sum(c.status == s for c in checks) for s in ("PASS", "FAIL", "SKIP")}
    line = f"selftest: {count['PASS']} passed, {count['FAIL']} failed, {count['SKIP']} skipped"
    if any(c.name == "cuda" and c.status == "SKIP" for c in checks):
        line += " -- no GPU: CUDA checks skipped"
    return line


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ssdtrain selftest", description=__doc__.split("\n\n")[0])
    p.add_argument("--path", default=None,
                   help="directory to offload to, on the drive training will use (default: $SSDTRAIN_PATH, else "
                        "the temporary directory); a private subdirectory is made and removed")
    p.add_argument("--json", metavar="FILE", default=None, help="also write the results as JSON to FILE")
    p.add_argument("--overlap-seconds", type=float, default=1.0, help="length of each timed GEMM loop (default 1)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.path is None:
        from ssdtrain.config import OffloadConfig

        args.path = OffloadConfig().paths[0]
    if not os.path.isdir(args.path):
        print(f"ssdtrain selftest: --path {args.path!r} is not a directory", file=sys.stderr)
        return 2

    def report(c: Check) -> None:
        print(f"{c.status:<4}  {c.name:<32} {c.detail}" + (f"  ({c.seconds:.1f} s)" if c.seconds >= 0.05 else ""),
              flush=True)

    # This process is ours: cuBLAS bit-reproducible across streams (read when its first handle
    # is made, so before any CUDA work) for the exact checks, unless the user chose otherwise.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    checks = run(args.path, report=report, overlap_seconds=args.overlap_seconds)
    summary = _summary(checks)
    print(summary)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"checks": [dataclasses.asdict(c) for c in checks], "summary": summary}, f, indent=2)
    return 1 if any(c.status == "FAIL" for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
