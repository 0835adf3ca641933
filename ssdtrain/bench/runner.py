"""``ssdtrain bench``'s run: the modes side by side, and the figures the table shows.

The modes (:mod:`ssdtrain.bench.modes`) train the same model (same initial weights, same
batches) in one process. Each round runs every mode once on the same batch, in alternating
order (baseline, recompute, offload, recompute+offload, save_on_cpu; then the reverse; ...), so
that noise from the machine hits all alike; the first round is a warm-up and is not counted.
Timed steps carry no instrumentation but the offloader's own counters; on a GPU they start and
end with a synchronize (Note [timing a GPU step] in ``_device.py``). Memory is measured before
them, in untimed steps in a child process (Note [memory in a child process] in ``_memory.py``).

The device (``BenchArgs.device``): ``cpu`` by default here, ``auto`` (the CLI's default) is CUDA
where available. On a GPU the model, its batches and the offloader's tensors live there, and
the default dtype is bfloat16 (float32 on the CPU).

What :func:`run` returns per mode (``result["modes"][name]``):

* **step time** - median over the timed steps (zero_grad, forward, backward, optimizer step),
  with forward and backward medians; the offload modes then wait, untimed, for the step's
  writes still in flight (``off.wait()``, reported apart), so that modes alternated in one
  process do not share the drive;
  **ratio** - the median over rounds of the step time divided by baseline's in the same round
  (Note [timing on a noisy machine]); and in ``vs``, the same against each peer that ran
  (baseline, recompute, save_on_cpu), with the peak-memory ratios.
* **peak saved** - one definition for every mode (Note [one peak saved for every mode] in
  ``modes.py``), measured in the untimed memory step: the most bytes of saved activations held
  in memory at any moment (unique storages; parameters and buffers excluded), plus, with
  checkpointing, one block's activations while it is recomputed. For the offload modes the
  saved bytes held are the offloader's resident bytes over time; for the others a
  ``saved_tensors_hooks`` counter's (for recompute: each block's input until its backward).
  The timed steps' own peaks (the offloader's ``peak_resident_bytes``) are in ``steps``.
* **peak RSS growth** - the child process's resident set sampled every ~2 ms during an untimed
  step (each mode's second), max minus the value at the step's start.
* **max memory allocated** (GPU) - ``torch.cuda.max_memory_allocated`` over that step, the mode
  alone in the child (weights, gradients, optimizer state, batch, activations); with the bytes
  allocated at its start, and the pinned host allocator's peak (``save_on_cpu``'s copies).
* **written / read** - bytes per step to and from the drive, their rate over the step time and
  that rate's share of the drive's; **stall** - median seconds per step compute waited on I/O.
* **drive** (offload modes) - the headline: **the peak's fall**, what offloading took off the
  step's peak of saved bytes (``unique - peak``, median over the timed steps), against what the
  drive could have taken before the peak, ``min(B_write * T_forward, saved)`` with T_forward the
  reference mode's and B the probe's raw O_DIRECT rate or the ``--drive-gbps`` limit, as "of the
  possible"; and against the same bound where forward saves its bytes late (the reference's
  saves over time, from the memory step: a save made at ``t`` has ``T_forward - t`` left to be
  written), "of the possible in time". Then what the drive could carry in a step,
  ``min(B_write * T_forward, B_read * T_backward)``, and the share of it that was written
  ("moved": bytes written, freed before the peak or not); the achieved rates beside the drive's
  raw ones and the limit; and the regime: whether the drive writes slower than forward makes
  activations (distinct saved bytes per second of the reference mode's forward: baseline's for
  offload, recompute's for recompute+offload).
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import os
import platform
import statistics
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ssdtrain.bench import _device
from ssdtrain.bench._progress import Progress
from ssdtrain.bench.drive import DriveLimit, choose_limit, drive_rates, limited, probe
from ssdtrain.bench.models import GPT, GPTConfig
from ssdtrain.bench.modes import MODES, OFFLOAD_MODES, PEERS, Mode, Step, offloader_factory

__all__ = ["DEVICES", "DTYPES", "MODES", "BenchArgs", "default_dtype", "run"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEVICES = _device.DEVICES
GB = 1e9
REFERENCE = {"offload": "baseline", "recompute+offload": "recompute"}
"""The mode each offload mode is compared with: the same model without offloading."""


@dataclass(kw_only=True)
class BenchArgs:
    """One bench run's settings (the CLI flags, resolved)."""

    model: GPTConfig
    batch: int
    steps: int
    """Timed steps per mode (after one warm-up step each)."""
    dtype: str | None = None
    """``float32`` or ``bfloat16``; ``None``: bfloat16 on a GPU, float32 on the CPU."""
    device: str = "cpu"
    """Where the model trains: ``cpu``, ``cuda``, ``cuda:N`` or ``auto`` (CUDA where available)."""
    modes: tuple[str, ...] = MODES
    path: str | None = None
    """Offload directory; ``None``: the OffloadConfig default ($SSDTRAIN_PATH or the temp dir)."""
    drive_gbps: float | None = None
    """Limit the offload modes' drive to this many GB/s each way; ``None``: no limit."""
    throttle: str = "auto"
    """How to limit it: ``cgroup`` (blkio, root), ``backend`` (ThrottledBackend), ``auto``."""
    work_dir: str | None = None
    """Where the token corpus is cached; ``None``: ~/.cache/ssdtrain/bench."""
    data: str = "auto"
    probe_bytes: int = 256 << 20
    seed: int = 0
    progress: bool | None = None
    keep_timeline: bool = False
    threads: int | None = None
    """torch intra-op threads; ``None``: torch's default."""


def _default_work_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ssdtrain", "bench")


def _machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "platform": platform.platform(),
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def default_dtype(device: torch.device) -> str:
    """The dtype the bench trains in when none is given: bfloat16 on a GPU (what mixed-precision
    training computes in there), float32 on the CPU (where bfloat16 kernels are slow)."""
    return "bfloat16" if device.type == "cuda" else "float32"


def gpu_memory_needed(cfg: GPTConfig, batch: int, dtype: torch.dtype, modes: int) -> tuple[int, int]:
    """``(needed, per_mode)``: a lower bound of the device bytes the timed rounds hold, where every
    mode keeps its own model and AdamW state on the device side by side (weights and the two
    moments in ``dtype``: ``per_mode``), plus one step's gradients, activations (at least 16
    elements per token and hidden unit a layer; 17 measured in bf16) and logits."""
    with torch.device("meta"):
        params = GPT(cfg).num_params()
    size = dtype.itemsize
    tokens = batch * cfg.seq
    per_mode = 3 * params * size
    step = params * size + cfg.layers * 16 * tokens * cfg.hidden * size + tokens * cfg.vocab * size
    return modes * per_mode + step, per_mode


def _check_gpu_memory(args: BenchArgs, dev: torch.device, dtype: torch.dtype) -> None:
    """Before any work: refuses a model the device cannot hold once per mode, saying what to change."""
    if dev.type != "cuda":
        return
    needed, per_mode = gpu_memory_needed(args.model, args.batch, dtype, len(args.modes))
    free = torch.cuda.mem_get_info(dev)[0]
    if needed > free:
        gib = 1 << 30
        raise ValueError(
            f"the bench keeps all {len(args.modes)} modes' models on {dev} side by side: at least "
            f"{needed / gib:.1f} GiB ({len(args.modes)} x {per_mode / gib:.1f} GiB of weights and AdamW state, "
            f"plus one step's gradients and activations), and {free / gib:.1f} GiB is free; pass fewer --modes, "
            "or a smaller --layers, --hidden, --seq or --batch")


def _check(args: BenchArgs) -> torch.device:
    """Validates ``args`` before any work; returns the device they resolve to."""
    bad = [m for m in args.modes if m not in MODES]
    if bad or not args.modes:
        raise ValueError(f"modes: unknown {', '.join(map(repr, bad)) or '(none given)'}; choose from {', '.join(MODES)}")
    if args.steps < 1 or args.batch < 1:
        raise ValueError(f"steps and batch must be >= 1, got {args.steps} and {args.batch}")
    if args.dtype is not None and args.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {args.dtype!r}")
    return _device.resolve_device(args.device)


def run(args: BenchArgs) -> dict:
    """Runs the bench and returns the result dict (the structure ``--json`` writes).

    Raises:
        ValueError: for bad settings, a device that is not here, or a drive limit that cannot be
            had, before any work is done.
    """
    from ssdtrain.bench._memory import measure_in_child
    from ssdtrain.config import OffloadConfig

    dev = _check(args)
    dtype_name = args.dtype or default_dtype(dev)
    _check_gpu_memory(args, dev, DTYPES[dtype_name])
    if args.threads:
        torch.set_num_threads(args.threads)
    paths = list(OffloadConfig(path=args.path).paths if args.path else OffloadConfig().paths)
    offloading = bool(set(args.modes) & set(OFFLOAD_MODES))
    limit = choose_limit(paths, args.drive_gbps, args.throttle) if offloading and args.drive_gbps else None
    result: dict[str, Any] = {"machine": {**_machine(), **_device.device_info(dev)}}
    drive: dict[str, Any] = {"paths": paths, "write_gbps": None, "read_gbps": None}
    if offloading:
        drive = probe(paths, args.probe_bytes, args.progress)  # the raw drive, before any limit
    drive["limit"] = limit.as_dict() if limit else None
    result["drive"] = drive

    cfg = args.model
    result["model"] = {**asdict(cfg), "batch": args.batch, "dtype": dtype_name, "device": str(dev),
                       "steps": args.steps, "warmup_steps": 1}
    if "save_on_cpu" in args.modes:
        result["save_on_cpu"] = {"pin_memory": dev.type == "cuda", "note": (
            "saved tensors are copied to pinned host memory and back" if dev.type == "cuda" else
            "on the CPU, tensors already there are not copied: the mode costs only its hooks and holds what "
            "baseline holds")}
    with limited(limit), (torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()):
        bar = Progress(total=len(args.modes) * (2 + args.steps), label="bench", enabled=args.progress)
        try:
            bar.draw("memory steps (child process)", force=True)
            spec = {"model": asdict(cfg), "dtype": dtype_name, "device": str(dev), "batch": args.batch,
                    "seed": args.seed, "threads": args.threads, "modes": list(args.modes), "path": args.path,
                    "limit": limit.as_dict() if limit else None}
            memory = measure_in_child(spec)
            bar.update(len(args.modes))
            with warnings.catch_warnings():
                # The report says what the drive carried (Note [say when the drive carries little]
                # in schedule.py gives a training run the same news as a warning).
                warnings.filterwarnings("ignore", message="ssdtrain: the drive took", category=RuntimeWarning)
                steps = _timed_rounds(args, cfg, dev, DTYPES[dtype_name], limit, bar, result)
        finally:
            bar.close()
    result["modes"] = _summarize(steps, memory, drive, limit)
    if args.keep_timeline:
        result["timeline"] = {name: memory[name]["timeline"] for name in args.modes}
    return result


def _timed_rounds(args: BenchArgs, cfg: GPTConfig, dev: torch.device, dtype, limit: DriveLimit | None,
                  bar: Progress, result: dict) -> dict[str, list[Step]]:
    from ssdtrain.bench.data import TokenLoader

    loader = TokenLoader(Path(args.work_dir or _default_work_dir()) / "corpus", batch_size=args.batch,
                         seq=cfg.seq, vocab=cfg.vocab, num_samples=max(256, 4 * args.batch),
                         seed=args.seed, backend=args.data, device=dev.type)
    result["input"] = {"backend": loader.backend}
    torch.manual_seed(args.seed)
    reference = GPT(cfg).to(dtype)  # on the CPU; each mode gets its copy on the device
    result["model"]["params"] = reference.num_params()
    make_offloader = offloader_factory(args.path, limit)
    modes: dict[str, Mode] = {}
    steps: dict[str, list[Step]] = {name: [] for name in args.modes}
    try:
        for name in args.modes:
            modes[name] = Mode(name, copy.deepcopy(reference).to(dev), make_offloader)
        del reference
        result["offload"] = {name: {"backend": m.off.stats().backend, "config": _config_dict(m.off.config)}
                             for name, m in modes.items() if m.off is not None}
        batches = iter(loader)
        # Note [timing on a noisy machine]: each round runs every mode once on the same batch,
        # in alternating order (A B, B A, ...) so that neither mode always follows the other;
        # ratios are taken within a round, where the machine's state is shared, and their
        # median over rounds is reported.
        for r in range(1 + args.steps):
            tokens, targets = next(batches)
            order = list(modes.items())
            for name, mode in order if r % 2 == 0 else reversed(order):
                bar.draw(f"{name} step {r}/{args.steps}" + (" (warm-up)" if r == 0 else ""), force=True)
                step = mode.timed_step(tokens, targets)
                if r > 0:
                    steps[name].append(step)
                    bar.update(note=f"{name} {step.seconds:.2f}s")
    finally:
        for name, mode in modes.items():
            if mode.off is not None and name in result.get("offload", {}):
                # The warm-up step's too: the drive may take less once the offloader has learnt it.
                result["offload"][name]["written_bytes_all_steps"] = mode.off.stats().written_bytes
            mode.close()
        loader.close()
    return steps


def _config_dict(config) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(config).items()}


def _per_round(ss: list[Step], ref: list[Step] | None) -> list[float] | None:
    return [s.seconds / b.seconds for s, b in zip(ss, ref)] if ref else None


def _summarize(steps: dict[str, list[Step]], memory: dict, drive: dict, limit: DriveLimit | None) -> dict:
    out: dict[str, dict] = {}
    base = steps.get("baseline")
    for name, ss in steps.items():
        t = statistics.median(s.seconds for s in ss)
        # Note [one peak saved for every mode] (modes.py): the memory step's, for every mode.
        peak_saved = memory[name]["peak_saved_bytes"]
        written = round(statistics.fmean(s.written for s in ss))
        read = round(statistics.fmean(s.read for s in ss))
        ratios = _per_round(ss, base)
        out[name] = {
            "step_time_s": t,
            "step_times_s": [s.seconds for s in ss],
            "forward_s": statistics.median(s.forward for s in ss),
            "backward_s": statistics.median(s.backward for s in ss),
            "wait_s": statistics.median(s.wait for s in ss),
            # Note [timing on a noisy machine]: the median of the per-round ratios.
            "step_time_ratio": statistics.median(ratios) if ratios else None,
            "step_time_ratios": ratios,
            "step_time_ratio_of_medians": t / statistics.median(b.seconds for b in base) if base else None,
            "peak_saved_bytes": peak_saved,
            "peak_rss_bytes": memory[name]["rss_growth_bytes"],
            "max_memory_allocated_bytes": memory[name].get("max_memory_allocated_bytes"),
            "memory_allocated_start_bytes": memory[name].get("memory_allocated_start_bytes"),
            "pinned_host_peak_bytes": memory[name].get("pinned_host_peak_bytes"),
            "peak_saved_bytes_per_step": [s.peak_saved for s in ss] if name in OFFLOAD_MODES else None,
            "written_bytes": written,
            "read_bytes": read,
            "unique_bytes": round(statistics.fmean(s.unique for s in ss)),
            "write_gbps": written / t / GB,
            "read_gbps": read / t / GB,
            "stall_s": statistics.median(s.stall for s in ss),
            "losses": [s.loss for s in ss],
            # Each timed step as measured (seconds, forward, backward, wait, bytes, stall): the
            # figures above are medians and means of these.
            "steps": [asdict(s) for s in ss],
        }
    bw, br = drive_rates(drive, limit)
    for name, row in out.items():
        for key, ref_key in (("peak_saved_ratio", "peak_saved_bytes"), ("peak_rss_ratio", "peak_rss_bytes"),
                             ("max_memory_allocated_ratio", "max_memory_allocated_bytes")):
            row[key] = _ratio(row[ref_key], out["baseline"][ref_key]) if "baseline" in out else None
        for kind, raw in (("write", bw), ("read", br)):
            row[f"{kind}_share_of_drive"] = row[f"{kind}_gbps"] / raw if raw else None
        row["vs"] = {peer: _versus(row, out[peer], steps[name], steps[peer]) for peer in PEERS
                     if peer in out and peer != name}
        if name == "recompute+offload" and "recompute" in out:
            row["vs_recompute"] = {k: row["vs"]["recompute"][k] for k in ("step_time_ratio", "peak_saved_ratio")}
        ref_name = REFERENCE.get(name)
        if name in OFFLOAD_MODES:
            forward_ref = out[ref_name]["forward_s"] if ref_name in out else row["forward_s"]
            row["drive"] = _drive_figures(row, bw, br, forward_ref, ref_name if ref_name in out else name)
            row["drive"].update(_peak_figures(steps[name], bw, forward_ref,
                                              memory.get(ref_name if ref_name in out else name)))
            row["drive"].update(raw_write_gbps=drive.get("write_gbps"), raw_read_gbps=drive.get("read_gbps"),
                                limit_gbps=limit.gbps if limit else None)
    return out


def _peak_figures(ss: list[Step], bw: float | None, forward_s: float, ref_memory: dict | None) -> dict:
    """The peak's fall (median over steps of ``unique - peak``) against what the drive could take
    before the peak: ``possible_bytes`` = ``min(B_write x T_forward, saved)``, and
    ``possible_in_time_bytes``, which also counts when forward saves its bytes (from the reference
    mode's saves over time in the memory step, its forward scaled to ``T_forward``)."""
    fall = statistics.median(s.unique - (s.peak_saved or 0) for s in ss)
    unique = statistics.median(s.unique for s in ss)
    fig: dict[str, Any] = {"peak_fall_bytes": fall, "peak_fall_share": fall / unique if unique else None,
                           "left_before_peak_bytes": statistics.median(s.left for s in ss),
                           "possible_bytes": None, "possible_in_time_bytes": None, "of_possible": None,
                           "of_possible_in_time": None}
    if bw:
        rate = bw * GB
        fig["possible_bytes"] = possible = min(rate * forward_s, unique)
        fig["of_possible"] = fall / possible if possible else None
        timeline = (ref_memory or {}).get("timeline")
        if timeline and timeline.get("forward_end"):
            in_time = min(possible, _possible_in_time(timeline["points"], timeline["forward_end"], rate, forward_s))
            fig["possible_in_time_bytes"] = in_time
            fig["of_possible_in_time"] = fall / in_time if in_time else None
    return fig


def _possible_in_time(points: list, forward_end: float, rate: float, forward_s: float) -> float:
    """At most what a drive of ``rate`` bytes/s writes before forward ends, given when forward
    saves (``points``: ``(seconds, saved bytes held)``, forward ending at ``forward_end``, scaled to
    ``forward_s``): for any moment ``t``, what was saved before ``t`` plus ``rate x (T - t)``."""
    scale = forward_s / forward_end
    best, made = rate * forward_s, 0.0
    for t, held in points:
        if t > forward_end:
            break
        best = min(best, made + rate * max(0.0, forward_s - t * scale))
        made = max(made, held)  # forward frees little: what it holds is what it has saved
    return min(best, made)


def _ratio(x: float | None, ref: float | None) -> float | None:
    return x / ref if x is not None and ref else None


def _versus(row: dict, peer: dict, ss: list[Step], peer_steps: list[Step]) -> dict:
    """A mode against a peer: step time (median of per-round ratios) and peak memory ratios."""
    return {"step_time_ratio": statistics.median(_per_round(ss, peer_steps)),
            "peak_saved_ratio": _ratio(row["peak_saved_bytes"], peer["peak_saved_bytes"]),
            "max_memory_allocated_ratio": _ratio(row["max_memory_allocated_bytes"],
                                                 peer["max_memory_allocated_bytes"])}


def _drive_figures(row: dict, bw: float | None, br: float | None, forward_ref: float, ref_name: str) -> dict:
    """What the drive could carry in this mode's step, what was moved, and the regime."""
    made = row["unique_bytes"] / forward_ref / GB  # GB/s of distinct saved bytes forward makes
    fig: dict[str, Any] = {"write_gbps": bw, "read_gbps": br, "forward_s": row["forward_s"],
                           "backward_s": row["backward_s"], "wait_s": row["wait_s"], "made_gbps": made,
                           "made_per": ref_name, "forward_ref_s": forward_ref,
                           "moved_bytes": row["written_bytes"], "capacity_bytes": None, "moved_share": None,
                           "drive_limited": None}
    if bw and br:
        capacity = min(bw * row["forward_s"], br * row["backward_s"]) * GB
        fig.update(capacity_bytes=capacity, moved_share=row["written_bytes"] / capacity if capacity else None,
                   drive_limited=made > bw)
    return fig
