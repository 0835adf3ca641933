"""Offload I/O against the drive's raw bandwidth, side by side in one run.

Three ways to move the same bytes, alternated round by round so that a drive (or a shared VM)
that drifts affects them alike:

* ``raw``       -- ``ssdtrain probe``: sequential O_DIRECT blocks from aligned memory, the limit;
* ``backend``   -- the storage backend alone (``allocate`` / ``submit_write`` / ``submit_read``)
                   on ordinary torch tensors, as the engine calls it;
* ``offloader`` -- end to end: an autograd graph that saves large activations through
                   ``ssdtrain.Offloader`` (write: first pack to ``wait()``; read: the backward,
                   whose compute is negligible).

Prints GB/s (10^9 bytes/s) for each, medians over rounds, and offload / raw ratios; the storage
issue's target is >= 0.9 for writes and reads. Run::

    python benchmarks/io_throughput.py --path /nvme/tmp --size 2GiB --rounds 5 [--json out.json]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence

import torch

import ssdtrain
from ssdtrain.tools import probe
from ssdtrain.config import OffloadConfig, parse_bytes
from ssdtrain.store import _fs, make_backend

GB = 1e9


def _activations(count: int, nbytes: int) -> list[torch.Tensor]:
    """``count`` distinct tensors of ``nbytes`` random-looking bytes (ordinary torch allocations)."""
    base = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    out = []
    for i in range(count):
        t = base.clone()
        t[:8] = torch.tensor(list(i.to_bytes(8, "little")), dtype=torch.uint8)
        out.append(t)
    return out


def measure_raw(path: str, size: int, block: int, threads: int) -> tuple[float, float]:
    r = probe.probe_path(path, size_bytes=size, block_bytes=block, threads=threads)
    return r.write_gbps, r.read_gbps


class BackendRun:
    """The backend alone: every tensor written, then read back into reload buffers.

    Holds one backend for all rounds, like a training run holds one offloader: the first
    (untimed) pass warms it up, later passes measure the steady state.
    """

    def __init__(self, cfg: OffloadConfig, acts: list[torch.Tensor], *, check: bool) -> None:
        self.backend = make_backend(cfg)
        self.acts = acts
        self.check = check
        self.total = sum(a.numel() for a in acts)
        self._extent_kw = "extent" in inspect.signature(self.backend.alloc_buffer).parameters
        self()

    def __call__(self) -> tuple[float, float]:
        b = self.backend
        start = time.perf_counter()
        extents = [b.allocate(a.numel()) for a in self.acts]
        for f in [b.submit_write(e, a) for e, a in zip(extents, self.acts)]:
            f.result()
        write_s = time.perf_counter() - start
        start = time.perf_counter()
        bufs = [b.alloc_buffer(a.numel(), a.device, **({"extent": e} if self._extent_kw else {}))
                for a, e in zip(self.acts, extents)]
        for f in [b.submit_read(e, buf) for e, buf in zip(extents, bufs)]:
            f.result()
        read_s = time.perf_counter() - start
        if self.check and not all(torch.equal(a, buf) for a, buf in zip(self.acts, bufs)):
            raise AssertionError("the backend read back different bytes")
        for e in extents:
            b.free(e)
        return self.total / write_s / GB, self.total / read_s / GB

    def close(self) -> None:
        self.backend.close()


class _Save(torch.autograd.Function):
    """Saves a large tensor for backward and does (almost) nothing else: pure offload I/O."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, act: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(act)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (act,) = ctx.saved_tensors
        return grad + act[:1].float() * 0, None


class OffloaderRun:
    """End to end: a training step whose saved tensors are the activations, through one
    :class:`ssdtrain.Offloader` kept for all rounds (the first, untimed step warms it up).

    Write: from the first pack to ``wait()`` (inside the ``with`` block, so that nothing is kept
    in memory). Read: the backward, whose compute is negligible.
    """

    def __init__(self, cfg: OffloadConfig, acts: list[torch.Tensor], *, check: bool) -> None:
        self.off = ssdtrain.Offloader(config=cfg)
        self.acts = acts
        self.check = check
        self.total = sum(a.numel() for a in acts)
        self()

    def __call__(self) -> tuple[float, float]:
        off = self.off
        before = off.stats()
        x = torch.zeros(1, requires_grad=True)
        start = time.perf_counter()
        with off:
            h = x
            for a in self.acts:
                h = _Save.apply(h, a)
            loss = h.sum()
            # Inside the block: leaving it starts backward, which keeps whatever is still
            # queued in memory (adaptive keep); this step measures the drive, so write it all.
            off.wait()
        write_s = time.perf_counter() - start
        mid = off.stats()
        if mid.written_bytes - before.written_bytes != self.total:
            raise AssertionError(f"the offloader wrote {mid.written_bytes - before.written_bytes} bytes "
                                 f"of {self.total}: not a pure I/O step")
        start = time.perf_counter()
        loss.backward()
        read_s = time.perf_counter() - start
        after = off.stats()
        if self.check and after.read_bytes - mid.read_bytes != self.total:
            raise AssertionError(f"the offloader read {after.read_bytes - mid.read_bytes} bytes of {self.total}")
        return self.total / write_s / GB, self.total / read_s / GB

    def close(self) -> None:
        self.off.close()


def run(path: str, *, size: int, tensor_bytes: int, rounds: int, io_threads: int, chunk_bytes: int,
        modes: Sequence[str] = ("raw", "backend", "offloader"), check: bool = True,
        progress=None) -> dict:
    """Measures every mode ``rounds`` times, alternating; returns figures, medians and ratios."""
    count = max(1, size // tensor_bytes)
    size = count * tensor_bytes
    cfg = OffloadConfig(path=path, backend="posix", min_bytes=0, keep_last_layers=0,
                        io_threads=io_threads, chunk_bytes=chunk_bytes,
                        max_inflight_bytes=max(size, 1 << 20), prefetch_bytes=max(size, 1 << 20),
                        when_full="wait")
    unknown = set(modes) - {"raw", "backend", "offloader"}
    if unknown:
        raise ValueError(f"unknown mode(s) {sorted(unknown)}; use raw, backend, offloader")
    acts = _activations(count, tensor_bytes) if set(modes) - {"raw"} else []
    runners = {"raw": lambda: measure_raw(path, size, chunk_bytes, io_threads)}
    try:
        if "backend" in modes:
            runners["backend"] = BackendRun(cfg, acts, check=check)
        if "offloader" in modes:
            runners["offloader"] = OffloaderRun(cfg, acts, check=check)
        runs: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
        for i in range(rounds):
            for m in modes:
                if progress:
                    progress(f"round {i + 1}/{rounds}: {m}")
                runs[m].append(runners[m]())
    finally:
        for r in runners.values():
            getattr(r, "close", lambda: None)()
    med = {m: (statistics.median(w for w, _ in v), statistics.median(r for _, r in v)) for m, v in runs.items()}
    ratios = {}
    if "raw" in med:
        rw, rr = med["raw"]
        ratios = {m: (w / rw, r / rr) for m, (w, r) in med.items() if m != "raw"}
    return {
        "machine": {"host": platform.node(), "kernel": platform.release(), "cpus": os.cpu_count(),
                    "python": platform.python_version(), "torch": torch.__version__},
        "path": os.path.abspath(path),
        "fs_type": _fs.fs_type(path),
        "direct_io": _fs.direct_io_supported(path),
        "size_bytes": size,
        "tensor_bytes": tensor_bytes,
        "io_threads": io_threads,
        "chunk_bytes": chunk_bytes,
        "rounds": rounds,
        "runs_gbps": {m: [list(x) for x in v] for m, v in runs.items()},
        "median_gbps": {m: list(v) for m, v in med.items()},
        "ratio_to_raw": {m: list(v) for m, v in ratios.items()},
    }


def format_report(res: dict) -> str:
    lines = [
        f"path {res['path']} ({res['fs_type']}, O_DIRECT {'yes' if res['direct_io'] else 'no'}); "
        f"{res['size_bytes'] / 2**20:.0f} MiB in tensors of {res['tensor_bytes'] / 2**20:.0f} MiB; "
        f"io_threads={res['io_threads']}, chunk={res['chunk_bytes'] >> 20} MiB; median of {res['rounds']} rounds",
        f"{'':<11}{'write GB/s':>11}{'read GB/s':>11}{'write/raw':>11}{'read/raw':>10}",
    ]
    for m, (w, r) in res["median_gbps"].items():
        rw, rr = res["ratio_to_raw"].get(m, (None, None))
        lines.append(f"{m:<11}{w:>11.2f}{r:>11.2f}"
                     + ("" if rw is None else f"{rw:>11.2f}{rr:>10.2f}"))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--path", default=None, help="directory on the drive (default: $SSDTRAIN_PATH or the temp dir)")
    p.add_argument("--size", default="1GiB", help="bytes moved per mode and round (default 1GiB)")
    p.add_argument("--tensor", default="64MiB", help="size of one activation (default 64MiB)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--io-threads", type=int, default=OffloadConfig().io_threads)
    p.add_argument("--chunk", default=None, help="request size (default: the config's chunk_bytes)")
    p.add_argument("--modes", default="raw,backend,offloader")
    p.add_argument("--json", help="also write the results as JSON here")
    args = p.parse_args(argv)
    path = args.path or OffloadConfig().paths[0]
    chunk = parse_bytes(args.chunk, name="--chunk") if args.chunk else OffloadConfig().chunk_bytes
    res = run(path, size=parse_bytes(args.size, name="--size"), tensor_bytes=parse_bytes(args.tensor, name="--tensor"),
              rounds=args.rounds, io_threads=args.io_threads, chunk_bytes=chunk,
              modes=[m for m in args.modes.split(",") if m],
              progress=lambda msg: print(msg, file=sys.stderr, flush=True))
    print(format_report(res))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
