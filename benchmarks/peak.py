"""How far offloading lowers the step's peak on a slow drive, against what the drive could take.

Note [write what leaves before the peak] (``ssdtrain/engine/peak.py``). The bench model at the shape of
the issue on the peak (8 blocks, hidden 512, 8 heads, seq 512, batch 8: 1.1 GiB saved per step),
``ssdtrain bench`` side by side in one process for each drive: baseline and offload, then
recompute and recompute+offload (checkpointed blocks), the drive capped at R MB/s each way by a
blkio cgroup (root; ``--throttle backend`` elsewhere), and unthrottled. Per run:

* step: the median over rounds of the offload mode's step over its reference's (baseline, or
  recompute when checkpointed) in the same round;
* written per step, and the peak over the step's unique saved bytes (``peak_resident_bytes``
  after ``reset_peak()``, median and worst over the timed steps);
* the peak's fall (``unique - peak``) of the possible, ``min(R x forward, saved)`` with the
  reference's forward time; and of the possible in time (which also counts that a save made late
  in forward has little time left to be written: ``ssdtrain/bench/runner.py``).

Usage (about 15 minutes on 2 cores)::

    python benchmarks/peak.py --json peak.json
    python benchmarks/peak.py --rates 100,25 --steps 5 --path /var/tmp/ssdtrain

The figures are computed here from each step's counters, so this script also measures an
older engine (``PYTHONPATH=<its checkout> python benchmarks/peak.py``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from ssdtrain.bench import BenchArgs, run
from ssdtrain.bench.models import preset

MIB = 1 << 20
PAIRS = {"plain": ("baseline", "offload"), "checkpointed": ("recompute", "recompute+offload")}


def _in_time(timeline: dict | None, rate: float, forward_s: float) -> float | None:
    """What a drive of ``rate`` bytes/s could write before forward ends, given when forward saves."""
    if not timeline or not timeline.get("forward_end"):
        return None
    scale = forward_s / timeline["forward_end"]
    best, made = rate * forward_s, 0.0
    for t, held in timeline["points"]:
        if t > timeline["forward_end"]:
            break
        best = min(best, made + rate * max(0.0, forward_s - t * scale))
        made = max(made, held)
    return min(best, made)


def figures(result: dict, ref: str, mode: str, rate: float) -> dict:
    """The issue's figures for ``mode`` against ``ref`` from one bench result; ``rate``: B/s."""
    r, o = result["modes"][ref], result["modes"][mode]
    steps = o["steps"]
    ratios = [a / b for a, b in zip(o["step_times_s"], r["step_times_s"])]
    shares = [s["peak_saved"] / s["unique"] for s in steps]
    falls = [s["unique"] - s["peak_saved"] for s in steps]
    unique = statistics.median(s["unique"] for s in steps)
    fall = statistics.median(falls)
    possible = min(rate * r["forward_s"], unique)
    timeline = (result.get("timeline") or {}).get(ref)
    in_time = _in_time(timeline, rate, r["forward_s"])
    in_time = None if in_time is None else min(in_time, possible)
    return {
        "step_ratio": statistics.median(ratios), "step_ratios": ratios,
        "written_bytes": statistics.fmean(s["written"] for s in steps), "unique_bytes": unique,
        "peak_share": statistics.median(shares), "peak_share_worst": max(shares),
        "fall_bytes": fall, "possible_bytes": possible, "of_possible": fall / possible if possible else None,
        "best_share": 1 - possible / unique, "possible_in_time_bytes": in_time,
        "of_possible_in_time": fall / in_time if in_time else None,
        "reference_forward_s": r["forward_s"], "stall_s": o["stall_s"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default="100,25", help="drive limits in MB/s each way, comma-separated (default 100,25)")
    ap.add_argument("--no-unthrottled", action="store_true", help="skip the run on the drive as it is")
    ap.add_argument("--kinds", default="plain,checkpointed")
    ap.add_argument("--steps", type=int, default=5, help="timed rounds per run (default 5)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="the bench's tiny model: a smoke run, not a measurement")
    ap.add_argument("--loss-chunk", type=int, default=0, metavar="TOKENS",
                    help="the loss in chunks of this many tokens (GPTConfig.loss_chunk): no whole logits saved")
    ap.add_argument("--throttle", choices=("auto", "cgroup", "backend"), default="cgroup")
    ap.add_argument("--path", help="offload directory (default: $SSDTRAIN_PATH, else the temp dir)")
    ap.add_argument("--json", metavar="PATH")
    ns = ap.parse_args(argv)
    rates: list[float | None] = [float(x) for x in ns.rates.split(",") if x.strip()]
    if not ns.no_unthrottled:
        rates.append(None)
    rows = []
    for mbps in rates:
        for kind in ns.kinds.split(","):
            ref, mode = PAIRS[kind]
            model = preset("quick" if ns.quick else "default").replace(loss_chunk=ns.loss_chunk or None)
            args = BenchArgs(model=model, batch=ns.batch, steps=ns.steps, modes=(ref, mode),
                             path=ns.path, drive_gbps=mbps / 1000 if mbps else None, throttle=ns.throttle,
                             progress=False, keep_timeline=True, probe_bytes=(8 << 20) if ns.quick else 256 << 20)
            result = run(args)
            rate = mbps * 1e6 if mbps else result["drive"]["write_gbps"] * 1e9
            fig = figures(result, ref, mode, rate)
            fig.update(drive_mbps=mbps, kind=kind, raw_write_gbps=result["drive"]["write_gbps"],
                       loss_chunk=ns.loss_chunk)
            rows.append({"figures": fig, "bench": result})
            _print_row(fig)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1, default=str)
            f.write("\n")
    return 0


def _print_row(f: dict) -> None:
    drive = f"{f['drive_mbps']:g} MB/s" if f["drive_mbps"] else f"unthrottled ({f['raw_write_gbps']:.2f} GB/s)"
    in_time = "-" if f["of_possible_in_time"] is None else f"{f['of_possible_in_time']:.0%}"
    kind = f["kind"] + (f", loss in chunks of {f['loss_chunk']}" if f.get("loss_chunk") else "")
    print(f"{drive:>26} {kind:>12}: step x{f['step_ratio']:.3f} (rounds {min(f['step_ratios']):.2f}-"
          f"{max(f['step_ratios']):.2f}), written {f['written_bytes'] / MIB:.0f} MiB/step, peak/unique "
          f"x{f['peak_share']:.3f} (worst x{f['peak_share_worst']:.3f}; best possible x{f['best_share']:.3f}), fall "
          f"{f['fall_bytes'] / MIB:.0f} MiB = {f['of_possible']:.0%} of the possible {f['possible_bytes'] / MIB:.0f} MiB, "
          f"{in_time} of the possible in time", flush=True)


if __name__ == "__main__":
    sys.exit(main())
