"""Step time with offloading vs without, on an 8-layer GPT-style decoder on the CPU.

Baseline and offloaded steps alternate in one process (the first of each is a warm-up); the
offloader runs with its default config. Prints the three figures issue 3 asks about:

* median step time offload / baseline            (target <= 1.05): the median over rounds of
  offload's step time over baseline's in the same round (the ratio of the two medians is
  printed beside it)
* stall_seconds as a share of the offload step   (target <  5%)
* offload peak_resident_bytes / baseline's peak saved-activation bytes   (target <= 25%)

Usage::

    python benchmarks/step_time.py                  # default bench model: 8 layers, h=512, s=512, batch 4
    python benchmarks/step_time.py --tiny           # seconds; what the test suite smoke-runs
    python benchmarks/step_time.py --path /nvme --steps 8 --json out.json --check

Measurement is ``ssdtrain bench``'s (see ``ssdtrain/bench.py``): timed steps carry no hooks;
baseline's saved bytes come from one extra untimed step with a saved-tensors counter.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from ssdtrain.bench import BenchArgs, format_table, run
from ssdtrain.models import GPTConfig, preset

TARGETS = {"step_time_ratio": 1.05, "stall_share": 0.05, "resident_share": 0.25}


def figures(result: dict) -> dict:
    """The three ratios from a bench result with modes baseline and offload."""
    base, off = result["modes"]["baseline"], result["modes"]["offload"]
    return {
        "step_time_ratio": off["step_time_ratio"],  # median of per-round ratios (see ssdtrain/bench.py)
        "step_time_ratio_of_medians": off["step_time_ratio_of_medians"],
        "step_time_ratios": off["step_time_ratios"],
        "step_time_ratio_ci95": off["step_time_ratio_ci95"],
        "step_time_ratio_unstolen": off["step_time_ratio_unstolen"],
        "more_stolen_rounds": off["more_stolen_rounds"],
        "stolen_share": max((m["stolen_share"] for m in (base, off) if m["stolen_share"] is not None), default=None),
        "stall_share": off["stall_s"] / off["step_time_s"],
        "resident_share": off["peak_saved_bytes"] / base["peak_saved_bytes"],
        "baseline_step_s": base["step_time_s"],
        "offload_step_s": off["step_time_s"],
        "baseline_saved_bytes": base["peak_saved_bytes"],
        "offload_peak_resident_bytes": off["peak_saved_bytes"],
    }


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
    ap.add_argument("--work-dir", help="token corpus cache")
    ap.add_argument("--data", choices=("auto", "dali", "torch"), default="auto")
    ap.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--check", action="store_true", help="exit 1 if a target is missed")
    ap.add_argument("--control", action="store_true",
                    help="also run baseline with forward's allocations on huge pages (offload's default "
                    "host_allocator), to tell that allocator's share of the step time from offloading's")
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
        modes=("baseline", "offload") + (("hugepages",) if ns.control else ()),
        path=ns.path,
        work_dir=ns.work_dir,
        data=ns.data,
        probe_bytes=(8 << 20) if ns.tiny else (256 << 20),
        progress=None,
        threads=ns.threads,
    )
    result = run(args)
    fig = figures(result)
    print(format_table(result))
    print()
    ok = True
    for key, label in (("step_time_ratio", "median step time offload/baseline"),
                       ("stall_share", "stall_seconds / offload step time"),
                       ("resident_share", "offload peak_resident_bytes / baseline saved bytes")):
        target = TARGETS[key]
        met = fig[key] <= target if key != "stall_share" else fig[key] < target
        ok &= met
        bound = "<=" if key != "stall_share" else "<"
        print(f"{label:<52} {fig[key]:7.3f}   target {bound} {target:.2f}   {'met' if met else 'MISSED'}")
        if key == "step_time_ratio":
            print(f"{'  per round':<52} {' '.join(f'{r:.3f}' for r in fig['step_time_ratios'])}")
            if fig["step_time_ratio_ci95"] is not None:
                lo, hi = fig["step_time_ratio_ci95"]
                print(f"{'  95% confidence interval of that median':<52} {lo:7.3f} - {hi:.3f}")
            print(f"{'  ratio of the two medians':<52} {fig['step_time_ratio_of_medians']:7.3f}")
            if fig["stolen_share"] is not None:
                print(f"{'  host steal (CPU time taken by the hypervisor)':<52} {fig['stolen_share']:7.3f}")
                print(f"{'  rounds where offload lost more to steal':<52} "
                      f"{fig['more_stolen_rounds']} of {len(fig['step_time_ratios'])}")
                print(f"{'  median ratio with steal taken out (estimate)':<52} {fig['step_time_ratio_unstolen']:7.3f}")
    if "hugepages" in result["modes"]:
        hp, off = result["modes"]["hugepages"], result["modes"]["offload"]
        per_round = [o / h for o, h in zip(off["step_time_ratios"], hp["step_time_ratios"])]
        fig["control_ratio"] = hp["step_time_ratio"]
        fig["offload_over_control"] = statistics.median(per_round)
        print(f"{'control: baseline on huge pages / baseline':<52} {fig['control_ratio']:7.3f}")
        print(f"{'  offload / that control (median over rounds)':<52} {fig['offload_over_control']:7.3f}")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"figures": fig, "targets": TARGETS, "bench": result}, f, indent=2, default=str)
            f.write("\n")
    return 1 if ns.check and not ok else 0


if __name__ == "__main__":
    sys.exit(main())
