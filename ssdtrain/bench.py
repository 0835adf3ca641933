"""``ssdtrain bench``: train a GPT-style decoder with and without offloading, side by side.

Three modes train the same model (same initial weights, same batches) in one process:

* ``baseline`` - plain PyTorch, every activation stays in memory;
* ``recompute`` - ``torch.utils.checkpoint`` per block (``use_reentrant=False``);
* ``offload`` - :class:`ssdtrain.Offloader` on the model, default config, at ``--path``.

A fourth mode, ``hugepages``, is a control run only when asked for (``--modes``): baseline with
forward's CPU allocations on huge pages, as the offloader's default ``host_allocator`` puts them
(Note [written tensors on huge pages] in ``ssdtrain/_hostalloc.py``). It tells how much of
offload's step time comes from that allocator rather than from the offloading.

Each round runs every mode once on the same batch, in alternating order (baseline, recompute,
offload; then offload, recompute, baseline; ...), so that noise from the machine hits all alike;
the first round is a warm-up and is not counted. Timed steps run with no instrumentation, on
glibc's usual allocator settings. Memory is measured before them, in untimed steps.

What the table reports, per mode:

* **step time** - median over the timed steps (zero_grad, forward, backward, optimizer step;
  for offload also ``off.wait()``); **vs base**: the median over rounds of the step time
  divided by baseline's in the same round (Note [timing on a noisy machine]).
* **peak saved** - the peak bytes of saved activations held in memory. For offload this is the
  offloader's own ``peak_resident_bytes`` (max over the timed steps). For baseline and
  recompute it is measured in one extra, untimed step with a ``saved_tensors_hooks`` counter of
  unique storages (parameters and buffers excluded), tracked until autograd frees them. For
  recompute, whose checkpointed blocks save through their own hooks, the counter adds what
  checkpointing holds: each block's input until that block's backward is done, and one block's
  activations (measured on a single block) while it is recomputed.
* **peak RSS growth** - the process's resident set sampled from ``/proc/self/statm`` every
  ~2 ms during an untimed step (each mode's second), max minus the value at the step's start.
  So that RSS follows live memory, those steps run with glibc's mmap threshold at 1 MiB (large
  tensors go back to the system when freed) and ``malloc_trim`` before each. The timed steps run
  after, with the thresholds back at what glibc reaches by itself (its page faults would slow
  every mode by ~20% on the machine this was built on).
* **written / read** - bytes per step to and from the drive; **write / read GB/s** - those
  over the median step time, beside the drive's raw O_DIRECT bandwidth measured by the probe at
  the start of the same run; **stall** - median seconds per step compute waited on I/O.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ssdtrain import _hostalloc
from ssdtrain._measure import (RssSampler, SavedMeter, block_saved_bytes, malloc_trimmer, mmap_large_allocations,
                               stolen_seconds, usual_allocations)
from ssdtrain._progress import Progress
from ssdtrain.models import GPT, GPTConfig, preset

__all__ = ["MODES", "BenchArgs", "format_table", "main", "run"]


MODES = ("baseline", "recompute", "offload")
CONTROL_MODES = ("hugepages",)  # run only when named in ``modes``
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
GB = 1e9


# --- settings -----------------------------------------------------------------------------------

@dataclass(kw_only=True)
class BenchArgs:
    """One bench run's settings (the CLI flags, resolved)."""

    model: GPTConfig
    batch: int
    steps: int
    """Timed steps per mode (after one warm-up step each)."""
    dtype: str = "float32"
    modes: tuple[str, ...] = MODES
    path: str | None = None
    """Offload directory; ``None``: the OffloadConfig default ($SSDTRAIN_PATH or the temp dir)."""
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


# --- the modes ----------------------------------------------------------------------------------

@dataclass
class _Step:
    seconds: float
    loss: float
    peak_saved: int | None = None
    written: int = 0
    read: int = 0
    stall: float = 0.0
    stolen: float | None = None  # CPU seconds the hypervisor took from this machine's CPUs


@dataclass
class _Timeline:
    points: list[tuple[float, int]] = field(default_factory=list)
    forward_end: float = 0.0
    backward_end: float = 0.0
    step_end: float = 0.0


class _Mode:
    """One mode's model, optimizer and (for offload) offloader."""

    def __init__(self, name: str, model: GPT, path: str | None) -> None:
        self.name = name
        self.model = model
        model.recompute = name == "recompute"
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        self.off = None
        self.huge_pages = name == "hugepages"
        if self.huge_pages:
            if not _hostalloc.available():
                raise ValueError(f"mode hugepages: {_hostalloc.unavailable_reason()}")
        if name == "offload":
            import ssdtrain

            self.off = ssdtrain.Offloader(model, path=path) if path else ssdtrain.Offloader(model)

    def _forward_backward(self, tokens, targets, marks: dict | None = None) -> float:
        self.opt.zero_grad(set_to_none=True)
        if self.off is not None:
            with self.off:
                loss = self.model(tokens, targets)
        elif self.huge_pages:
            _hostalloc.use()
            try:
                loss = self.model(tokens, targets)
            finally:
                _hostalloc.release()
        else:
            loss = self.model(tokens, targets)
        if marks is not None:
            marks["forward_end"] = time.perf_counter()
        loss.backward()
        if self.off is not None:
            self.off.wait()
        if marks is not None:
            marks["backward_end"] = time.perf_counter()
        self.opt.step()
        return float(loss.detach())

    def timed_step(self, tokens, targets) -> _Step:
        before = self.off.stats() if self.off is not None else None
        if self.off is not None:
            self.off.reset_peak()
        stolen = stolen_seconds()
        t0 = time.perf_counter()
        loss = self._forward_backward(tokens, targets)
        step = _Step(seconds=time.perf_counter() - t0, loss=loss)
        after_stolen = stolen_seconds()
        if stolen is not None and after_stolen is not None:
            step.stolen = after_stolen - stolen
        if self.off is not None:
            after = self.off.stats()
            step.peak_saved = after.peak_resident_bytes
            step.written = after.written_bytes - before.written_bytes
            step.read = after.read_bytes - before.read_bytes
            step.stall = after.stall_seconds - before.stall_seconds
        return step

    def measure_step(self, tokens, targets, block_bytes: int, sampler: RssSampler) -> tuple[int, _Timeline, int | None]:
        """An untimed step recording saved bytes over time; returns (peak, timeline, RSS growth)."""
        marks: dict[str, float] = {}
        sampler.start()
        if self.off is not None:
            self.off.reset_peak()
            points = self.off.record_timeline(True)
            t0 = time.perf_counter()
            self._forward_backward(tokens, targets, marks)
            end = time.perf_counter()
            self.off.record_timeline(False)
            peak = self.off.stats().peak_resident_bytes
            points = [(t - t0, b) for t, b in points if t >= t0]
        else:
            meter = SavedMeter(self.model, recompute_block_bytes=block_bytes if self.model.recompute else 0)
            t0 = meter.t0
            try:
                with meter:
                    self._forward_backward(tokens, targets, marks)
            finally:
                meter.close()
            end = time.perf_counter()
            peak = meter.peak
            points = [(t - t0, b) for t, b in meter.timeline]
        growth = sampler.stop()
        timeline = _Timeline(points=[(0.0, points[0][1] if points else 0)] + points,
                             forward_end=marks["forward_end"] - t0,
                             backward_end=marks["backward_end"] - t0, step_end=end - t0)
        return peak, timeline, growth

    def close(self) -> None:
        if self.off is not None:
            self.off.close()


# --- the run ------------------------------------------------------------------------------------

def _probe(paths: list[str], size: int, progress: bool | None) -> dict:
    """Raw drive bandwidth of the offload paths (summed over paths), or why not."""
    drive: dict[str, Any] = {"paths": paths, "write_gbps": None, "read_gbps": None}
    try:
        from ssdtrain.probe import probe_path
    except ImportError as exc:
        drive["error"] = f"probe unavailable: {exc}"
        return drive
    results = []
    for path in paths:
        os.makedirs(path, exist_ok=True)
        bar = Progress(total=size, label=f"probe {path}", enabled=progress)

        def show(phase: str, done: int, total: int, bar: Progress = bar) -> None:
            bar.total = total  # one bar per phase (the probe's phases have their own totals)
            bar.set(done, phase)

        try:
            results.append(probe_path(path, size_bytes=size, progress=show))
        except (OSError, ValueError) as exc:
            drive["error"] = f"probe of {path} failed: {exc}"
            return drive
        finally:
            bar.close()
    drive["write_gbps"] = sum(r.write_gbps for r in results)
    drive["read_gbps"] = sum(r.read_gbps for r in results)
    drive["probe"] = [r.as_dict() for r in results]
    drive["warnings"] = [w for r in results for w in r.warnings]
    return drive


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


def run(args: BenchArgs) -> dict:
    """Runs the bench and returns the result dict (the structure ``--json`` writes)."""
    from ssdtrain.config import OffloadConfig
    from ssdtrain.data import TokenLoader

    for mode in args.modes:
        if mode not in MODES + CONTROL_MODES:
            raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES + CONTROL_MODES)}")
    if args.steps < 1 or args.batch < 1:
        raise ValueError(f"steps and batch must be >= 1, got {args.steps} and {args.batch}")
    dtype = DTYPES[args.dtype]
    if args.threads:
        torch.set_num_threads(args.threads)
    paths = list(OffloadConfig(path=args.path).paths if args.path else OffloadConfig().paths)
    result: dict[str, Any] = {"machine": _machine()}

    drive = {"paths": paths, "write_gbps": None, "read_gbps": None}
    if "offload" in args.modes:
        drive = _probe(paths, args.probe_bytes, args.progress)
    result["drive"] = drive

    cfg = args.model
    loader = TokenLoader(Path(args.work_dir or _default_work_dir()) / "corpus", batch_size=args.batch,
                         seq=cfg.seq, vocab=cfg.vocab, num_samples=max(256, 4 * args.batch),
                         seed=args.seed, backend=args.data)
    torch.manual_seed(args.seed)
    reference = GPT(cfg).to(dtype)
    result["model"] = {**asdict(cfg), "params": reference.num_params(), "batch": args.batch,
                       "dtype": args.dtype, "steps": args.steps, "warmup_steps": 1}
    result["input"] = {"backend": loader.backend}
    modes = {name: _Mode(name, copy.deepcopy(reference), args.path) for name in args.modes}
    del reference
    if "offload" in modes:
        off = modes["offload"].off
        result["offload"] = {"backend": off.backend, "config": _config_dict(off.config),
                             "host_allocator": off.host_allocator, "host_allocator_reason": off.host_allocator_reason}

    sampler = RssSampler()
    steps: dict[str, list[_Step]] = {name: [] for name in modes}
    rounds = 1 + args.steps
    bar = Progress(total=rounds * len(modes) + len(modes), label="bench", enabled=args.progress)
    batches = iter(loader)
    try:
        # Memory first, in untimed steps. So that RSS follows live memory, large allocations go
        # back to the system when freed. The first such step of a mode pays for its first
        # allocations, so each mode runs two and the second one counts.
        tokens, targets = next(batches)
        block_bytes = 0
        if "recompute" in modes:
            m = modes["recompute"].model
            block_bytes = block_saved_bytes(m.blocks[0], args.batch, cfg.seq, cfg.hidden, dtype)
        mmap_large_allocations()
        trim = malloc_trimmer()
        measured = {}
        for name, mode in modes.items():
            bar.draw(f"{name} memory timeline", force=True)
            for _ in range(2):
                trim()
                _hostalloc.trim()  # blocks kept for reuse (Note [reuse freed blocks]) count as they fill
                measured[name] = mode.measure_step(tokens, targets, block_bytes, sampler)
            bar.update()
        # Then time, with the allocator as glibc runs it unattended (that setting's page faults
        # slow every mode by ~20% on the machine this was built on).
        usual_allocations()
        # Note [timing on a noisy machine]: each round runs every mode once on the same batch,
        # in alternating order (A B, B A, ...) so that neither mode always follows the other;
        # ratios are taken within a round, where the machine's state is shared, and their median
        # over rounds is reported. On a virtual machine the host may also run other guests on
        # our CPUs (``steal``): measured on the machine this was built on, from none to two
        # thirds of the CPU time in a 2 s window, and per-round ratios from 0.8 to 2.0 while it
        # lasted. Each timed step therefore records the steal during it; the report gives its
        # share and, beside the ratio, the median of per-round ratios of step times less steal per
        # CPU. That second figure is an estimate (steal is counted per machine, not per step's
        # critical path) and no target is judged on it; it says how much of a bad figure the
        # host accounts for. Steal is not always independent of what we run: on a virtual disk
        # the host does work for every request, and when the host is busy that work can be
        # taken from our CPUs. In a 30-round run at 15% steal, offload's steps lost more to the
        # host than baseline's in 28 rounds, and the per-round ratio tracked the difference
        # (correlation 0.96). The report therefore counts those rounds per mode (and names the
        # likely cause only when a sign test puts the count below 5% chance), and gives a
        # distribution-free 95% interval for the median ratio: with 12 rounds it spans the
        # 3rd to the 10th smallest ratio.
        for r in range(rounds):
            tokens, targets = next(batches)
            order = list(modes.items())
            for name, mode in order if r % 2 == 0 else reversed(order):
                bar.draw(f"{name} step {r}/{args.steps}" + (" (warm-up)" if r == 0 else ""), force=True)
                step = mode.timed_step(tokens, targets)
                if r > 0:
                    steps[name].append(step)
                bar.update(note=f"{name} {step.seconds:.2f}s")
    finally:
        bar.close()
        for mode in modes.values():
            mode.close()
        loader.close()
        sampler.close()

    result["modes"] = _summarize(steps, measured, drive)
    if args.keep_timeline:
        result["timeline"] = {name: asdict(t) for name, (_, t, _) in measured.items()}
    return result


def _config_dict(config) -> dict:
    out = {}
    for k, v in asdict(config).items():
        out[k] = list(v) if isinstance(v, tuple) else v
    return out


def _unstolen(s: _Step, cpus: int) -> float | None:
    """The step's time less the hypervisor's steal per CPU: what it would have taken on a quiet
    host, roughly (every CPU computes through a step, so each lost about its share)."""
    return None if s.stolen is None else max(s.seconds - s.stolen / cpus, 1e-9)


def _stolen_share(s: _Step, cpus: int) -> float | None:
    """The share of the machine's CPU time the hypervisor took during the step."""
    return None if s.stolen is None else s.stolen / (s.seconds * cpus)


def sign_test_p(k: int, n: int) -> float:
    """The chance of ``k`` or more of ``n`` rounds going one way when either way is as likely
    (one-sided sign test): small when a mode really does lose more to the host."""
    return sum(math.comb(n, i) for i in range(k, n + 1)) / 2 ** n


def median_interval(values: list[float], coverage: float = 0.95) -> tuple[float, float] | None:
    """A distribution-free confidence interval for the median of ``values``: the k-th smallest
    and k-th largest value, with k the largest rank whose interval still covers the median with
    probability ``coverage`` (each value falls either side of the median with probability 1/2,
    so the count below it is binomial). None when there are too few values for that coverage
    (fewer than 6 for 95%)."""
    xs = sorted(values)
    n = len(xs)
    best = None
    for k in range(1, (n + 1) // 2 + 1):
        # The median lies below the k-th smallest value when at most k - 1 values fall below
        # it, as likely as n - k + 1 or more falling above it; the same again on the other side.
        if 1 - 2 * sign_test_p(n - k + 1, n) < coverage:
            break
        best = (xs[k - 1], xs[n - k])
    return best


def _summarize(steps: dict[str, list[_Step]], measured: dict, drive: dict) -> dict:
    out: dict[str, dict] = {}
    base_times = [s.seconds for s in steps["baseline"]] if "baseline" in steps else None
    cpus = os.cpu_count() or 1
    base_unstolen = [_unstolen(s, cpus) for s in steps["baseline"]] if "baseline" in steps else None
    base_shares = [_stolen_share(s, cpus) for s in steps["baseline"]] if "baseline" in steps else None
    for name, ss in steps.items():
        t = statistics.median(s.seconds for s in ss)
        if name == "offload":
            peak_saved = max(s.peak_saved or 0 for s in ss)  # the worst step: what memory must hold
        else:
            peak_saved = measured[name][0]
        rss = measured[name][2]
        written = round(statistics.fmean(s.written for s in ss))
        read = round(statistics.fmean(s.read for s in ss))
        ratios = [s.seconds / b for s, b in zip(ss, base_times)] if base_times else None
        unstolen = [_unstolen(s, cpus) for s in ss]
        adjusted = ([u / b for u, b in zip(unstolen, base_unstolen)]
                    if base_unstolen and None not in unstolen and None not in base_unstolen else None)
        shares = [_stolen_share(s, cpus) for s in ss]
        out[name] = {
            "step_time_s": t,
            "step_times_s": [s.seconds for s in ss],
            # Note [timing on a noisy machine]: the median of the per-round ratios.
            "step_time_ratio": statistics.median(ratios) if ratios else None,
            "step_time_ratio_ci95": median_interval(ratios) if ratios else None,
            "step_time_ratios": ratios,
            "step_time_ratio_of_medians": t / statistics.median(base_times) if base_times else None,
            "peak_saved_bytes": peak_saved,
            "peak_rss_bytes": rss,
            "peak_saved_bytes_per_step": [s.peak_saved for s in ss] if name == "offload" else None,
            "written_bytes": written,
            "read_bytes": read,
            "write_gbps": written / t / GB,
            "read_gbps": read / t / GB,
            "stall_s": statistics.median(s.stall for s in ss),
            # Note [timing on a noisy machine]: what the host took, and the ratio without it.
            "stolen_share": statistics.median(shares) if None not in shares else None,
            "stolen_shares": shares,
            # Rounds in which the host took a larger share from this mode's step than from
            # baseline's: on a virtual disk the host's own I/O work for us can be charged to our
            # CPUs as steal (Note [timing on a noisy machine]).
            "more_stolen_rounds": (sum(a > b for a, b in zip(shares, base_shares))
                                   if base_shares and None not in shares and None not in base_shares else None),
            "step_time_ratio_unstolen": statistics.median(adjusted) if adjusted else None,
            "losses": [s.loss for s in ss],
        }
    base = out.get("baseline")
    for row in out.values():
        for key, ref_key in (("peak_saved_ratio", "peak_saved_bytes"), ("peak_rss_ratio", "peak_rss_bytes")):
            ref = base[ref_key] if base else None
            row[key] = row[ref_key] / ref if ref and row[ref_key] is not None else None
        for kind in ("write", "read"):
            raw = drive.get(f"{kind}_gbps")
            row[f"{kind}_share_of_drive"] = row[f"{kind}_gbps"] / raw if raw else None
    return out


# --- output -------------------------------------------------------------------------------------

def _fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"x{x:.2f}"


def format_table(result: dict) -> str:
    """The human-readable report ``ssdtrain bench`` prints."""
    m, mach, drive = result["model"], result["machine"], result["drive"]
    lines = [
        f"model: {m['layers']} layers, hidden {m['hidden']}, {m['heads']} heads, seq {m['seq']}, "
        f"vocab {m['vocab']}, {m['params'] / 1e6:.1f}M params; batch {m['batch']}, {m['dtype']}; "
        f"{m['steps']} timed steps per mode after 1 warm-up, modes alternated",
        f"machine: {mach['cpu']}, {mach['cpus']} CPUs, torch {mach['torch']}, {mach['date']}",
        f"input: {result['input']['backend']} pipeline",
    ]
    if drive.get("write_gbps") is not None:
        probe = drive.get("probe") or [{}]
        io = "O_DIRECT" if all(p.get("direct_io") for p in probe) else "buffered"
        fs = ",".join(sorted({p.get("fs_type", "?") for p in probe}))
        lines.append(f"drive: {', '.join(drive['paths'])} ({fs}, {io}): raw write "
                     f"{drive['write_gbps']:.2f} GB/s, read {drive['read_gbps']:.2f} GB/s (probe, same run)")
        lines += [f"  warning: {w}" for w in drive.get("warnings", [])]
    elif "offload" in result["modes"]:
        lines.append(f"drive: {', '.join(drive['paths'])}: raw bandwidth unknown ({drive.get('error', 'no probe')})")
    if "offload" in result:
        lines.append(f"offload backend: {result['offload']['backend']}")
        if "host_allocator" in result["offload"]:
            lines.append(f"host allocator: {result['offload']['host_allocator']} "
                         f"({result['offload']['host_allocator_reason']})")
    head = ("mode", "step", "vs base", "peak saved", "vs base", "peak RSS+", "vs base",
            "written", "read", "write GB/s", "read GB/s", "stall")
    rows = [head]
    for name, r in result["modes"].items():
        def bw(kind: str) -> str:
            if not r["written_bytes" if kind == "write" else "read_bytes"]:
                return "-"
            share = r[f"{kind}_share_of_drive"]
            return f"{r[f'{kind}_gbps']:.2f}" + (f" ({share:.0%})" if share is not None else "")
        rows.append((
            name, f"{r['step_time_s']:.3f}s", _ratio(r["step_time_ratio"]),
            _fmt_bytes(r["peak_saved_bytes"]), _ratio(r["peak_saved_ratio"]),
            _fmt_bytes(r["peak_rss_bytes"]), _ratio(r["peak_rss_ratio"]),
            _fmt_bytes(r["written_bytes"]) if r["written_bytes"] else "-",
            _fmt_bytes(r["read_bytes"]) if r["read_bytes"] else "-",
            bw("write"), bw("read"), f"{r['stall_s']:.3f}s" if name == "offload" else "-",
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines.append("")
    for i, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        lines.append("  ".join(cells))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    stolen = [r["stolen_share"] for r in result["modes"].values() if r.get("stolen_share") is not None]
    if stolen and max(stolen) >= 0.01:
        lines.append("")
        per_mode = ", ".join(f"{name} {r['stolen_share']:.0%}" for name, r in result["modes"].items()
                             if r.get("stolen_share") is not None)
        lines.append(f"host: the hypervisor took this share of the machine's CPU time during timed steps "
                     f"(median per step): {per_mode}; step times are that much noisier")
        for name, r in result["modes"].items():
            if name == "baseline":
                continue
            if r.get("more_stolen_rounds") is not None:
                k, n = r["more_stolen_rounds"], len(r["stolen_shares"])
                lines.append(f"  {name} steps lost more to the host than baseline's in {k} of {n} rounds" + (
                    " (on a virtual disk the host's work for our I/O can be charged to our CPUs)"
                    if sign_test_p(k, n) < 0.05 else ""))
            if r.get("step_time_ratio_unstolen") is not None:
                lines.append(f"  {name} vs base with steal taken out of each step: "
                             f"{_ratio(r['step_time_ratio_unstolen'])} (an estimate)")
    lines.append("")
    lines.append("step: median; vs base (step): median over rounds of the ratio to baseline's step in the same "
                 "round; peak saved: saved-activation bytes in memory; peak RSS+: resident set growth within a "
                 "step; written/read: per step; GB/s: per step time (share of raw)")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    """Saved-activation bytes over one step per mode, forward and backward marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timelines = result["timeline"]
    fig, axes = plt.subplots(len(timelines), 1, figsize=(8, 2.4 * len(timelines)), squeeze=False)
    for ax, (name, tl) in zip(axes[:, 0], timelines.items()):
        pts = tl["points"] + [(tl["step_end"], tl["points"][-1][1] if tl["points"] else 0)]
        xs = [p[0] for p in pts]
        ys = [p[1] / 2**20 for p in pts]
        ax.step(xs, ys, where="post", color="C0")
        ax.axvspan(0, tl["forward_end"], color="C2", alpha=0.12, label="forward")
        ax.axvspan(tl["forward_end"], tl["backward_end"], color="C3", alpha=0.12, label="backward")
        ax.set_title(name, loc="left", fontsize=10)
        ax.set_ylabel("saved MiB")
        ax.legend(loc="upper right", fontsize=8)
    axes[-1, 0].set_xlabel("seconds since step start")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# --- command line -------------------------------------------------------------------------------

def _size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("b").removesuffix("i")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="ssdtrain bench",
        description="Train a GPT-style decoder in the modes baseline, recompute and offload, "
        "alternated step by step, and print step time, memory and drive traffic side by side.",
    )
    ap.add_argument("--quick", action="store_true", help="tiny model and few steps (seconds)")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--heads", type=int)
    ap.add_argument("--seq", type=int)
    ap.add_argument("--vocab", type=int)
    ap.add_argument("--batch", type=int, help="sequences per step (default 4; --quick 8)")
    ap.add_argument("--steps", type=int, help="timed steps per mode after one warm-up (default 3)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    ap.add_argument("--naive-attention", action="store_true", help="materialise the s x s scores")
    ap.add_argument("--modes", default=",".join(MODES),
                    help="comma-separated, from " + ",".join(MODES + CONTROL_MODES) + " (default: the first three)")
    ap.add_argument("--path", help="offload directory (default: $SSDTRAIN_PATH, else the temp dir)")
    ap.add_argument("--work-dir", help="cache for the token corpus (default ~/.cache/ssdtrain/bench)")
    ap.add_argument("--data", choices=("auto", "dali", "torch"), default="auto",
                    help="input pipeline (auto: DALI if installed)")
    ap.add_argument("--probe-size", type=_size, help="bytes the drive probe writes and reads (default 256MiB)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    ap.add_argument("--plot", metavar="PATH", help="draw each mode's memory timeline (needs matplotlib)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap


def args_from_cli(ns: argparse.Namespace) -> BenchArgs:
    base = preset("quick" if ns.quick else "default")
    model = base.replace(layers=ns.layers, hidden=ns.hidden, heads=ns.heads, seq=ns.seq, vocab=ns.vocab,
                         flash=False if ns.naive_attention else None)
    modes = tuple(m.strip() for m in ns.modes.split(",") if m.strip())
    return BenchArgs(
        model=model,
        batch=ns.batch or (8 if ns.quick else 4),
        steps=ns.steps or 3,
        dtype=ns.dtype,
        modes=modes,
        path=ns.path,
        work_dir=ns.work_dir,
        data=ns.data,
        probe_bytes=ns.probe_size or ((64 << 20) if ns.quick else (256 << 20)),
        seed=ns.seed,
        progress=False if ns.no_progress else None,
        keep_timeline=bool(ns.plot),
        threads=ns.threads,
    )


def main(argv: list[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    if ns.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("ssdtrain bench: --plot needs matplotlib; pip install 'ssdtrain[plot]'", file=sys.stderr)
            return 2
    try:
        args = args_from_cli(ns)
        bad = [m for m in args.modes if m not in MODES + CONTROL_MODES]
        if bad or not args.modes:
            raise ValueError(f"--modes: unknown {', '.join(bad) or '(empty)'}; "
                             f"choose from {', '.join(MODES + CONTROL_MODES)}")
    except ValueError as exc:
        print(f"ssdtrain bench: {exc}", file=sys.stderr)
        return 2
    try:
        result = run(args)
    except ImportError as exc:
        print(f"ssdtrain bench: {exc}", file=sys.stderr)
        return 2
    print(format_table(result))
    if ns.json:
        data = {k: v for k, v in result.items() if k != "timeline"}
        with open(ns.json, "w") as f:
            json.dump(data, f, indent=2, default=str)
            f.write("\n")
    if ns.plot:
        plot(result, ns.plot)
        print(f"memory timeline: {ns.plot}")
    return 0
