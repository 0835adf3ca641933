"""What every rank of the pipeline-bubble benchmark (``benchmarks/pipeline_bubbles.py``, issue 66)
shares, whatever its engine (``_pipe_megatron.py``, ``_pipe_deepspeed.py``): its arguments, the
model's shape, the data, the memory it holds, the timeline of its forwards and backwards, and the
result it writes (``rank<N>.json``).

A rank's result:

    {"rank", "engine", "mode", "stages", "virtual", "dp", "micro_batch", "microbatches", "global_batch",
     "stage", "dp_rank",
     "steps": [{"step_s", "pipe_s", "busy_s", "idle_share", "forwards", "backwards"}, ...]  (measured steps),
     "events": [[kind, microbatch, t0, t1], ...]   (the last measured step's, seconds from its start),
     "losses": [the mean loss of each step, measured or not; null off the last stage],
     "held_bytes", "growth_bytes", "peak_bytes"    (the measured steps' largest),
     "offloaded_bytes", "kept_bytes", "versions": {...}}

``pipe_s`` is the engine's forward-backward over the step's micro-batches, ``step_s`` that plus
the gradients' reduction over the data-parallel ranks and the optimizer's step. ``busy_s`` is the
time the rank spent in forwards and backwards; ``idle_share`` is ``1 - busy_s / pipe_s``: the
rank's bubble (and its point-to-point waits) in the pipeline's part of the step.

Memory, on the CPU, as ``ssdtrain bench --max-seq`` measures it (Note [a CPU probe stops at its
budget] in ssdtrain/bench/_maxseq_child.py): ``held_bytes`` is what the rank holds between steps
(weights and optimizer state; gradients are freed before the measured step), ``growth_bytes`` the
resident set's growth during the step (sampled on a thread; the launcher fixes
``MALLOC_MMAP_THRESHOLD_`` so that freed memory goes back), ``peak_bytes`` their sum.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass

import torch

MODES = ("baseline", "recompute", "offload", "recompute+offload")


@dataclass(frozen=True)
class Shape:
    """A GPT-shaped model: ``layers`` blocks of ``hidden`` with ``heads`` heads, a sequence of
    ``seq`` tokens, a vocabulary of ``vocab``; no dropout (the runs compare losses exactly)."""

    layers: int = 8
    hidden: int = 256
    heads: int = 4
    seq: int = 256
    vocab: int = 4096

    def tokens_per_sequence(self) -> int:
        return self.seq


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--mode", choices=MODES, required=True)
    p.add_argument("--stages", type=int, required=True, help="pipeline stages; the rest of the ranks are data-parallel")
    # not --virtual: torchrun's own parser would take it for an abbreviation of --virtual-local-rank
    p.add_argument("--chunks", dest="virtual", type=int, default=1,
                   help="model chunks a stage (Megatron's interleaved schedule)")
    p.add_argument("--micro-batch", type=int, required=True, help="sequences a micro-batch")
    p.add_argument("--global-batch", type=int, required=True, help="sequences an optimizer step, all ranks")
    p.add_argument("--shape", default="{}", help="the model's Shape as JSON (fields not given: the defaults)")
    p.add_argument("--steps", type=int, default=3, help="measured steps")
    p.add_argument("--warmup", type=int, default=1, help="steps before the measured ones")
    p.add_argument("--storage", required=True, help="a directory for the offloaded activations")
    p.add_argument("--offload-config", default="{}", type=json.loads,
                   help="OffloadConfig fields for the offload modes beside the benchmark's (JSON), e.g. "
                   '\'{"when_full": "wait", "max_inflight_bytes": 67108864}\': memory first, at the drive\'s pace')
    p.add_argument("--out", required=True, help="a directory for rank<N>.json")
    p.add_argument("--timeout", type=float, default=300.0, help="gloo's timeout, seconds")
    return p


def shape_of(args: argparse.Namespace) -> Shape:
    return Shape(**json.loads(args.shape))


def microbatches(args: argparse.Namespace, world: int) -> tuple[int, int]:
    """``(data-parallel ranks, micro-batches a step on each)``; a clear error if the batch does
    not divide."""
    if world % args.stages:
        raise SystemExit(f"--stages {args.stages} does not divide the {world} ranks")
    dp = world // args.stages
    per_rank, rest = divmod(args.global_batch, dp * args.micro_batch)
    if rest or per_rank < 1:
        raise SystemExit(f"--global-batch {args.global_batch} is not a multiple of {dp} data-parallel ranks x "
                         f"--micro-batch {args.micro_batch}")
    return dp, per_rank


def batch(shape: Shape, step: int, index: int, dp_rank: int, size: int, per_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch ``index`` (of ``per_rank``) of ``step`` on data-parallel rank ``dp_rank``:
    ``(tokens, labels)``, ``(size, seq)`` each; the same on every stage of a pipeline. A step's
    sequences are numbered across the ranks (rank ``d`` has ``[d x per_rank x size, ...)``), each
    drawn from its own seed: every configuration of a global batch trains on the same sequences."""
    first = (dp_rank * per_rank + index) * size
    rows = []
    for k in range(first, first + size):
        g = torch.Generator().manual_seed(step * 1_000_003 + k)
        rows.append(torch.randint(0, shape.vocab, (shape.seq + 1,), generator=g))
    t = torch.stack(rows)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


class Timeline:
    """The rank's forwards and backwards in a step: ``[kind, microbatch, t0, t1]``, seconds from
    the step's start."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.events: list[list] = []

    def begin_step(self) -> None:
        self.start = time.perf_counter()
        self.events = []

    def wrap(self, kind: str, fn, microbatch_of=lambda *a, **k: None):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.events.append([kind, microbatch_of(*args, **kwargs), t0 - self.start,
                                    time.perf_counter() - self.start])
        timed.__wrapped__ = fn
        return timed

    def busy(self) -> float:
        return sum(t1 - t0 for _, _, t0, t1 in self.events)


def held_bytes(params, optimizer) -> int:
    """Weights, gradients present and the optimizer's state, in bytes."""
    total = 0
    for p in params:
        total += p.numel() * p.element_size()
        if p.grad is not None:
            total += p.grad.numel() * p.grad.element_size()
    for st in optimizer.state.values():
        for t in st.values():
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def versions() -> dict:
    out = {"torch": torch.__version__}
    for name in ("deepspeed", "megatron.core"):
        try:
            mod = __import__(name, fromlist=["__version__"])
            out[name] = getattr(mod, "__version__", "?")
        except Exception:  # noqa: BLE001 - an engine not installed is simply not listed
            pass
    return out


def write(out_dir: str, rank: int, result: dict) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def summary(steps: list[dict]) -> dict:
    """The measured steps' medians."""
    return {k: statistics.median(s[k] for s in steps) for k in ("step_s", "pipe_s", "busy_s", "idle_share")}


def header(args: argparse.Namespace, engine: str, world: int) -> dict:
    dp, m = microbatches(args, world)
    return {"engine": engine, "mode": args.mode, "stages": args.stages, "virtual": args.virtual, "dp": dp,
            "micro_batch": args.micro_batch, "microbatches": m, "global_batch": args.global_batch,
            "shape": asdict(shape_of(args)), "versions": versions()}


STAT_FIELDS = ("written_bytes", "read_bytes", "forwarded_bytes", "kept_bytes", "stall_seconds", "read_stall_seconds",
               "backpressure_stall_seconds", "backpressure_waits", "writes", "reads", "prefetch_misses",
               "drive_write_bps")


def offload_stats(stats) -> dict:
    """The offloader's counters a rank reports (empty without one): what went to the drive, what
    came back by a read or from memory, and how long compute waited on it."""
    return {k: getattr(stats, k) for k in STAT_FIELDS} if stats is not None else {}
