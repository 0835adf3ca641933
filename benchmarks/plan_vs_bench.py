"""Does ``ssdtrain plan`` predict how far ``ssdtrain bench``'s peak falls on a slow drive?

Runs ``ssdtrain bench`` (the bench model; baseline, recompute, offload, recompute+offload) with
the drive unthrottled, then throttled to 1/2, 1/10 and 1/40 of the rate at which the bench
model's forward makes activations (measured in the first run). For each run and offload mode it
gives the planner's drive-limited model (:mod:`ssdtrain.planner.plan_drive`) the bench model's
dimensions, the drive's rates as the bench reports them, the offloader's settings and a compute
rate, and compares the peak's fall it predicts (the bytes written and out of memory before
forward ends: Note [write what leaves before the peak]) with the fall the bench measured
(``unique - peak`` per step, the median), and the bytes written likewise.

The compute rate is the one the offload mode achieved in that run (FLOPs of forward over its
forward seconds; backward likewise): on a shared VM the same forward takes from 0.6 to 3 s from
one minute to the next, so only the step's own times say how long the drive had. The bench
reports the mean bytes per step and the median seconds: with two timed steps (the default)
the median is the mean too. The prediction from the rate of the mode
without offloading in the same run (baseline's; recompute's for recompute+offload) is shown
beside it, and carries that noise::

    python benchmarks/plan_vs_bench.py                 # about 4 minutes on 2 cores
    python benchmarks/plan_vs_bench.py --steps 3 --fractions 2,10,40 --throttle backend --json out.json

A prediction passes when the predicted fall is within ``--tolerance`` (20%) of the measured one,
or within one save (an entry is freed whole, and the last one may miss the end by a hair).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from ssdtrain.planner import plan_drive, plan_saves, plan_simulate
from ssdtrain.planner.plan import Inputs

MODES = ("offload", "recompute+offload")
REFERENCE = {"offload": "baseline", "recompute+offload": "recompute"}
DTYPES = {"float32": "fp32", "bfloat16": "bf16"}
MIB = 1 << 20


def run_bench(gbps: float | None, args: argparse.Namespace, out: str) -> dict:
    cmd = [sys.executable, "-m", "ssdtrain.cli", "bench", "--modes", "baseline,recompute,offload,recompute+offload",
           "--steps", str(args.steps), "--probe-size", "8MiB" if args.quick else "64MiB", "--no-progress",
           "--json", out] + (["--quick"] if args.quick else [])
    for flag in ("path", "work_dir"):
        if getattr(args, flag):
            cmd += [f"--{flag.replace('_', '-')}", getattr(args, flag)]
    if gbps is not None:
        cmd += ["--drive-gbps", f"{gbps:.6g}", "--throttle", args.throttle]
    print("$ " + " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(out) as f:
        return json.load(f)


def predict(result: dict, mode: str, rate_of: str | None = None) -> tuple[plan_simulate.DriveStep, dict]:
    """The planner's step for ``mode`` of a bench result, and the Inputs it was given; the compute
    rate is that of mode ``rate_of`` in the same run (default: ``mode`` itself)."""
    m = result["model"]
    ref = result["modes"][rate_of or mode]
    row = result["modes"][mode]
    config = result["offload"][mode]["config"]
    flops = plan_saves.forward_flops(layers=m["layers"], seq=m["seq"], hidden=m["hidden"], vocab=m["vocab"],
                                     micro_batch=m["batch"])
    if mode == "recompute+offload":
        # A checkpointed backward includes the layers' recomputation; the planner adds that itself.
        layers_flops = flops - plan_saves.forward_flops(layers=0, seq=m["seq"], hidden=m["hidden"],
                                                        vocab=m["vocab"], micro_batch=m["batch"])
        plain_backward = ref["backward_s"] - ref["forward_s"] * layers_flops / flops
        # At a tiny size fixed costs dominate, and backward can come out shorter than that.
        plain_backward = max(plain_backward, ref["backward_s"] / 4)
    else:
        plain_backward = ref["backward_s"]
    fields = dict(
        layers=m["layers"], hidden=m["hidden"], heads=m["heads"], seq=m["seq"], vocab=m["vocab"], gpus=1,
        gpu_mem_gib=1024.0, global_batch=m["batch"], stages=1, dtype=DTYPES[m["dtype"]], flash=m["flash"],
        dropout=m["dropout"] > 0, tflops=flops / ref["forward_s"] / 1e12,
        backward_tflops=2 * flops / plain_backward / 1e12,
        drive_gbps=row["drive"]["write_gbps"], drive_read_gbps=row["drive"]["read_gbps"],
        min_bytes=config["min_bytes"],
        # What the offloader hands to the drive at once (offloader.py): 2 x chunk_bytes x io_threads per path.
        handoff_bytes=2 * config["chunk_bytes"] * config["io_threads"] * len(config["path"]),
        host_gbps=0.0,  # the bench ran on the CPU: no host tier (it is for CUDA saves)
    )
    return plan_drive.drive_step(Inputs(**fields), mode, 1, m["batch"]), fields


def _cli(fields: dict, mode: str) -> str:
    """The ``ssdtrain plan`` command with the same inputs (its drive-limited section shows the prediction)."""
    flags = [f"--{k.replace('_', '-')} " + (f"{fields[k]:.6g}" if isinstance(fields[k], float) else f"{fields[k]}")
             for k in ("layers", "hidden", "heads", "seq", "vocab", "gpus", "gpu_mem_gib", "global_batch", "stages",
                       "dtype", "tflops", "backward_tflops", "drive_gbps", "drive_read_gbps", "min_bytes",
                       "host_gbps")]
    flags.append(f"--handoff-mib {fields['handoff_bytes'] / MIB:g}")
    flags += [] if fields["flash"] else ["--no-flash"]
    flags += [] if fields["dropout"] else ["--no-dropout"]
    return f"ssdtrain plan {' '.join(flags)}   # {mode} row"


def compare(runs: list[tuple[float | None, dict]], tolerance: float) -> list[dict]:
    """One record per run and offload mode: the prediction, the measurement, their ratio."""
    records = []
    for k, result in runs:
        for mode in MODES:
            step, fields = predict(result, mode)
            fall_pred = step.free_bytes
            from_ref = predict(result, mode, REFERENCE[mode])[0].free_bytes
            row = result["modes"][mode]
            fall = row["drive"]["peak_fall_bytes"]
            ratio = fall_pred / fall if fall else (1.0 if fall_pred == 0 else float("nan"))
            largest = max((s.nbytes for s in plan_saves.saves(
                layers=fields["layers"], seq=fields["seq"], hidden=fields["hidden"], heads=fields["heads"],
                vocab=fields["vocab"], micro_batch=result["model"]["batch"], dtype_bytes=4 if fields["dtype"] == "fp32"
                else 2, flash=fields["flash"], dropout=fields["dropout"], checkpoint=mode != "offload",
                head=True, tflops=fields["tflops"], backward_tflops=fields["backward_tflops"])[0]), default=0)
            records.append({
                "fraction": k, "mode": mode, "drive_gbps": row["drive"]["write_gbps"], "inputs": fields,
                "predicted_fall_bytes": fall_pred, "predicted_written_bytes": step.written_bytes,
                "predicted_fall_bytes_from_reference_rate": from_ref, "possible_bytes": step.possible_bytes,
                "measured": {"peak_fall_bytes": fall, **{key: row[key] for key in (
                    "written_bytes", "read_bytes", "forward_s", "backward_s", "step_time_s", "step_times_s")}},
                "ratio": ratio, "pass": abs(ratio - 1) <= tolerance or abs(fall_pred - fall) <= largest,
                "command": _cli(fields, mode)})
    return records


def print_table(records: list[dict], tolerance: float) -> None:
    head = ("drive GB/s", "mode", "predicted fall", "measured fall", "ratio", "pass", "from reference rate",
            "possible", "predicted written", "measured written")
    rows = [head]
    for r in records:
        k, m = r["fraction"], r["measured"]
        rows.append((f"{r['drive_gbps']:.3f}" + (" (raw)" if k is None else f" (1/{k:g})"), r["mode"],
                     f"{r['predicted_fall_bytes'] / MIB:.1f} MiB", f"{m['peak_fall_bytes'] / MIB:.1f} MiB",
                     f"{r['ratio']:.2f}", "yes" if r["pass"] else "NO",
                     f"{r['predicted_fall_bytes_from_reference_rate'] / MIB:.1f} MiB",
                     f"{r['possible_bytes'] / MIB:.1f} MiB", f"{r['predicted_written_bytes'] / MIB:.1f} MiB",
                     f"{m['written_bytes'] / MIB:.1f} MiB"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    print()
    for i, row in enumerate(rows):
        print("  ".join(c.ljust(w) if j < 2 else c.rjust(w) for j, (c, w) in enumerate(zip(row, widths))))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    print(f"\n{sum(r['pass'] for r in records)}/{len(records)} predictions of the peak's fall within {tolerance:.0%} "
          "(or one save); "
          "compute rate: each offload mode's own, in its run; the first prediction's command:")
    print("  " + records[0]["command"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2, help="timed steps per mode and run (default 2)")
    ap.add_argument("--fractions", default="2,10,40",
                    help="drive speeds as divisors of the activation rate, comma-separated (default 2,10,40)")
    ap.add_argument("--rate", type=float, metavar="GBPS",
                    help="the activation rate the fractions divide (default: measured by a first, unthrottled run)")
    ap.add_argument("--throttle", choices=("auto", "cgroup", "backend"), default="auto")
    ap.add_argument("--tolerance", type=float, default=0.20)
    ap.add_argument("--quick", action="store_true", help="the bench's tiny model (a smoke run, not a measurement)")
    ap.add_argument("--path", help="the bench's offload directory (default: its own)")
    ap.add_argument("--work-dir", help="the bench's token-corpus cache (default: its own)")
    ap.add_argument("--json", metavar="PATH", help="write the bench results and the predictions here")
    ap.add_argument("--again", metavar="PATH", help="compare again the bench results of an earlier --json, no run")
    args = ap.parse_args(argv)
    if args.again:
        with open(args.again) as f:
            saved = json.load(f)
        fractions = saved.get("fractions") or list(dict.fromkeys(r["fraction"] for r in saved["records"]))
        rate, runs = saved["activation_gbps"], list(zip(fractions, saved["bench"]))
    else:
        fractions = [float(x) for x in args.fractions.split(",") if x.strip()]
        work = tempfile.mkdtemp(prefix="plan_vs_bench-")
        runs, rate = [], args.rate
        if rate is None:
            runs = [(None, run_bench(None, args, os.path.join(work, "unthrottled.json")))]
            rate = runs[0][1]["modes"]["offload"]["drive"]["made_gbps"]
        print(f"the bench model's forward makes activations at {rate:.3f} GB/s", flush=True)
        for k in fractions:
            runs.append((k, run_bench(rate / k, args, os.path.join(work, f"1-{k:g}.json"))))

    records = compare(runs, args.tolerance)
    print_table(records, args.tolerance)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"activation_gbps": rate, "records": records, "fractions": [k for k, _ in runs],
                       "bench": [r for _, r in runs]}, f, indent=2, default=str)
            f.write("\n")
    return 0 if all(r["pass"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
