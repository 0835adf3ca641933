"""The bench's memory steps, run in a child process: peak saved bytes, RSS growth, timelines.

Note [memory in a child process]
RSS follows live memory only if the C allocator gives freed memory back. glibc serves tensors
under its mmap threshold (which it raises by itself, up to 32 MiB, after the first large free)
from heaps it keeps, so in a process that has run a few steps a step's RSS growth says what the
heaps had room for, not what the step held (measured on the bench model: 0 to 340 MiB for the
same mode from one round to the next). The child runs with ``MALLOC_MMAP_THRESHOLD_`` fixed at
1 MiB, so every large tensor is its own mapping, returned when freed, and each mode runs in a
fresh model; the bench process itself, which times the steps, keeps glibc's defaults and is
never reconfigured. The child gets the same model (same seed), batch size and drive limit (a
blkio cgroup is inherited; the backend throttle is rebuilt from the limit), and one random
batch: memory does not depend on the tokens. On a GPU the child also counts each mode's device
memory alone (Note [peak device memory per step] in ``_device.py``): modes do not share its
allocator, and ``max_memory_allocated`` says what one mode needs, as in a training process.

The child reads a JSON spec on stdin and writes one JSON line to stdout::

    {"model": {...GPTConfig fields}, "dtype": "float32", "device": "cpu" | "cuda:0", "batch": 8,
     "seed": 0, "threads": null, "modes": ["baseline", ...], "path": null,
     "limit": null | {"gbps": .., "method": .., ...}}
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

__all__ = ["measure_in_child"]

MMAP_THRESHOLD = 1 << 20


def measure_in_child(spec: dict) -> dict:
    """Runs the memory steps of ``spec["modes"]`` in a child process (Note [memory in a child
    process]); returns ``{mode: {"peak_saved_bytes", "rss_growth_bytes", "timeline",
    "max_memory_allocated_bytes", "memory_allocated_start_bytes", "pinned_host_peak_bytes"}}``
    (the last three ``None`` on the CPU) and ``"block_bytes"`` (one block's saved bytes, what
    recomputing it holds)."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(MMAP_THRESHOLD))
    root = str(Path(__file__).resolve().parents[2])  # the directory holding the ssdtrain package
    env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    proc = subprocess.run([sys.executable, "-m", "ssdtrain.bench._memory"], input=json.dumps(spec),
                          capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"the bench's memory steps (a child process) failed with status {proc.returncode}:\n"
                           f"{proc.stderr[-4000:]}")
    if proc.stderr.strip():
        sys.stderr.write(proc.stderr)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _measure(spec: dict) -> dict:
    import torch

    from ssdtrain.bench._measure import RssSampler, block_saved_bytes
    from ssdtrain.bench.drive import DriveLimit
    from ssdtrain.bench.models import GPT, GPTConfig
    from ssdtrain.bench.modes import RECOMPUTE_MODES, Mode, offloader_factory

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[spec["dtype"]]
    dev = torch.device(spec.get("device", "cpu"))
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    cfg = GPTConfig(**spec["model"])
    batch = spec["batch"]
    torch.manual_seed(spec["seed"])
    reference = GPT(cfg).to(dtype)  # stays on the CPU: only the mode measured is on the device
    g = torch.Generator().manual_seed(spec["seed"])
    raw = torch.randint(0, cfg.vocab, (batch, cfg.seq + 1), generator=g).to(dev)
    tokens, targets = raw[:, :-1].contiguous(), raw[:, 1:].contiguous()
    limit = DriveLimit(**{**spec["limit"], "devices": tuple(spec["limit"]["devices"])}) if spec.get("limit") else None
    make_offloader = offloader_factory(spec.get("path"), limit)
    block_bytes = 0
    if set(spec["modes"]) & set(RECOMPUTE_MODES):
        block_bytes = block_saved_bytes(copy.deepcopy(reference.blocks[0]).to(dev), batch, cfg.seq, cfg.hidden,
                                        dtype, dev)
    sampler = RssSampler()
    out: dict = {"block_bytes": block_bytes}
    for name in spec["modes"]:
        mode = Mode(name, copy.deepcopy(reference).to(dev), make_offloader)
        try:
            # The first step of a mode pays for its first allocations; the second one counts.
            for _ in range(2):
                peak, timeline, memory = mode.measure_step(tokens, targets, block_bytes, sampler)
        finally:
            mode.close()
        out[name] = {"peak_saved_bytes": peak, **memory, "timeline": asdict(timeline)}
        del mode
    sampler.close()
    return out


def main() -> int:
    import contextlib

    import torch

    spec = json.loads(sys.stdin.read())
    dev = torch.device(spec.get("device", "cpu"))
    with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
        result = _measure(spec)
    sys.stdout.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
