"""Step time with offloading vs without, on an 8-layer GPT-style decoder on the CPU.

Baseline and offloaded steps alternate in one process (the first of each is a warm-up); the
offloader runs with its default config. Prints the bench's table and three figures:

* median step time offload / baseline            (target <= 1.05): the median over rounds of
  offload's step time over baseline's in the same round (the ratio of the two medians is
  printed beside it)
* stall_seconds as a share of the offload step   (target <  5%)
* offload peak_resident_bytes / baseline's peak saved-activation bytes   (target <= 25%)

With ``--recompute`` the same for recompute+offload against recompute (checkpointing per block,
its checkpoints offloaded), with no targets. With ``--drive-gbps X`` the offload modes run on a
drive limited to X GB/s each way (``--throttle``: a blkio cgroup where root can make one, else
a rate limit in the backend), and the table says what that drive could carry per step.

Usage::

    python benchmarks/step_time.py                  # default bench model: 8 layers, h=512, s=512, batch 4
    python benchmarks/step_time.py --tiny           # seconds; what the test suite smoke-runs
    python benchmarks/step_time.py --drive-gbps 0.2 --recompute
    python benchmarks/step_time.py --path /nvme --steps 8 --json out.json --check

Measurement is ``ssdtrain bench``'s (see ``ssdtrain/bench/runner.py``): timed steps carry no
hooks; saved bytes without offloading come from untimed steps with a saved-tensors counter.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from ssdtrain.bench import BenchArgs, format_table, run
from ssdtrain.bench.drive import THROTTLES
from ssdtrain.bench.models import GPTConfig, preset

TARGETS = {"step_time_ratio": 1.05, "stall_share": 0.05, "resident_share": 0.25}


def figures(result: dict, mode: str = "offload", ref: str = "baseline") -> dict:
    """The three ratios of ``mode`` against ``ref`` from a bench result that ran both."""
    r, o = result["modes"][ref], result["modes"][mode]
    per_round = [a / b for a, b in zip(o["step_times_s"], r["step_times_s"])]
    return {
        "step_time_ratio": statistics.median(per_round),  # the bench's: median of per-round ratios
        "step_time_ratio_of_medians": o["step_time_s"] / r["step_time_s"],
        "step_time_ratios": per_round,
        "stall_share": o["stall_s"] / o["step_time_s"],
        "resident_share": o["peak_saved_bytes"] / r["peak_saved_bytes"],
        f"{ref}_step_s": r["step_time_s"],
        f"{mode}_step_s": o["step_time_s"],
        f"{ref}_saved_bytes": r["peak_saved_bytes"],
        f"{mode}_peak_resident_bytes": o["peak_saved_bytes"],
        "drive": o.get("drive"),
    }


def _print(fig: dict, mode: str, ref: str, targets: dict | None) -> bool:
    ok = True
    labels = (("step_time_ratio", f"median step time {mode}/{ref}"),
              ("stall_share", f"stall_seconds / {mode} step time"),
              ("resident_share", f"{mode} peak saved / {ref} saved bytes"))
    for key, label in labels:
        line = f"{label:<52} {fig[key]:7.3f}"
        if targets:
            target = targets[key]
            met = fig[key] < target if key == "stall_share" else fig[key] <= target
            ok &= met
            bound = "<" if key == "stall_share" else "<="
            line += f"   target {bound} {target:.2f}   {'met' if met else 'MISSED'}"
        print(line)
        if key == "step_time_ratio":
            print(f"{'  per round':<52} {' '.join(f'{r:.3f}' for r in fig['step_time_ratios'])}")
            print(f"{'  ratio of the two medians':<52} {fig['step_time_ratio_of_medians']:7.3f}")
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="8 tiny layers, 1 timed step: a smoke run")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--heads", type=int)
    ap.add_argument("--seq", type=int)
    ap.add_argument("--batch", type=int)
    ap.add_argument("--steps", type=int, help="timed steps per mode (default 12; --tiny 1)")
    ap.add_argument("--path", help="offload directory (default: $SSDTRAIN_PATH, else the temp dir)")
    ap.add_argument("--drive-gbps", type=float, metavar="X", help="limit the drive to X GB/s each way")
    ap.add_argument("--throttle", choices=THROTTLES, default="auto", help="how (default auto: cgroup where possible)")
    ap.add_argument("--recompute", action="store_true", help="also recompute vs recompute+offload")
    ap.add_argument("--work-dir", help="token corpus cache")
    ap.add_argument("--data", choices=("auto", "dali", "torch"), default="auto")
    ap.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--check", action="store_true", help="exit 1 if a target is missed")
    ns = ap.parse_args(argv)

    if ns.tiny:
        model = GPTConfig(vocab=256, seq=64, layers=8, hidden=64, heads=4)
    else:
        model = preset("default")
    model = model.replace(layers=ns.layers, hidden=ns.hidden, heads=ns.heads, seq=ns.seq)
    if model.layers < 8 and not ns.tiny:
        print("step_time: the benchmark is defined for >= 8 layers", file=sys.stderr)
    args = BenchArgs(
        model=model,
        batch=ns.batch or (4 if not ns.tiny else 2),
        steps=ns.steps or (1 if ns.tiny else 12),
        modes=("baseline", "offload") + (("recompute", "recompute+offload") if ns.recompute else ()),
        path=ns.path,
        drive_gbps=ns.drive_gbps,
        throttle=ns.throttle,
        work_dir=ns.work_dir,
        data=ns.data,
        probe_bytes=(8 << 20) if ns.tiny else (256 << 20),
        progress=None,
        threads=ns.threads,
    )
    try:
        result = run(args)
    except ValueError as exc:
        print(f"step_time: {exc}", file=sys.stderr)
        return 2
    print(format_table(result))
    print()
    fig = figures(result)
    ok = _print(fig, "offload", "baseline", TARGETS)
    out = {"figures": fig, "targets": TARGETS, "bench": result}
    if ns.recompute:
        print()
        out["recompute_figures"] = figures(result, "recompute+offload", "recompute")
        _print(out["recompute_figures"], "recompute+offload", "recompute", None)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(out, f, indent=2, default=str)
            f.write("\n")
    return 1 if ns.check and not ok else 0


if __name__ == "__main__":
    sys.exit(main())
