"""Issue 66: does offloading buy a pipeline fewer bubbles and more tokens a second, in Megatron-Core
and DeepSpeed? Ranks are processes over gloo on this machine, each under the same memory budget.

For a fixed global batch and each mode (baseline, recompute, offload, recompute+offload) the search
runs every configuration 2 ranks admit: stages (1: the ranks are data-parallel; 2: a 1F1B
pipeline; Megatron also interleaved, 2 chunks a stage) x micro-batch size (the micro-batches
follow from the global batch). Each configuration is one launch of ``torch.distributed.run`` with
the engine's rank script (``_pipe_megatron.py``, ``_pipe_deepspeed.py``; the result a rank writes
is in ``_pipe_common.py``), which measures each rank's resident growth as ``ssdtrain bench
--max-seq`` does: a configuration fits where every rank's peak is within ``--budget-mib``. Then
the best configuration of each mode that fits (the most tokens a second) runs ``--rounds`` more
times, the modes alternated in each round; the report gives each mode's median tokens a second,
its ratio to the best without offloading, each rank's measured idle share of the pipeline's part
of the step beside ``(p-1)/(m+p-1)``, the peak, the bytes offloaded, and whether the losses of a
configuration are equal with and without offloading; beside it, ``ssdtrain plan`` given this
machine's measured rates (``_pipe_planner.py``) chooses each mode's configuration, and the rounds time
its choice too where it differs from the search's.

    python benchmarks/pipeline_bubbles.py --engines megatron --budget-mib 200 --rounds 3 --out OUT.jsonl

Each probe's record is a line of ``--out`` (JSON); ``--report OUT.jsonl`` prints the tables of
a finished run again.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _pipe_common as common  # noqa: E402
import _pipe_planner as planner  # noqa: E402

RANKS = 2
SCRIPTS = {"megatron": "_pipe_megatron.py", "deepspeed": "_pipe_deepspeed.py"}
MMAP_THRESHOLD = 64 << 10  # freed memory goes back to the system: a step's growth is its own


def configs(engine: str, global_batch: int) -> list[dict]:
    """Every (stages, chunks a stage, micro-batch) 2 ranks can run ``global_batch`` with."""
    out = []
    for stages in (1, 2):
        dp = RANKS // stages
        for virtual in ((1, 2) if stages > 1 and engine == "megatron" else (1,)):
            mb = 1
            while mb * dp <= global_batch:
                m = global_batch // (mb * dp)
                if global_batch % (mb * dp) == 0 and (virtual == 1 or m % stages == 0):
                    out.append({"stages": stages, "virtual": virtual, "micro_batch": mb})
                mb *= 2
    return out


def bubble(stages: int, m: int, virtual: int = 1) -> float:
    """1F1B's idle share of the pipeline's part of a step: ``(p-1)/(v m + p-1)``."""
    return (stages - 1) / (virtual * m + stages - 1)


def probe(engine: str, mode: str, cfg: dict, args: argparse.Namespace) -> dict:
    """One launch: both ranks' results, combined."""
    with tempfile.TemporaryDirectory(prefix="ssdtrain-pipe-", dir=args.storage) as tmp:
        out_dir = os.path.join(tmp, "out")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={RANKS}",
               os.path.join(HERE, SCRIPTS[engine]), "--mode", mode, "--stages", str(cfg["stages"]),
               "--chunks", str(cfg["virtual"]), "--micro-batch", str(cfg["micro_batch"]),
               "--global-batch", str(args.global_batch), "--shape", json.dumps(asdict(args.shape)),
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--storage", os.path.join(tmp, "store"),
               "--out", out_dir, "--offload-config", json.dumps(args.offload_config)]
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(MMAP_THRESHOLD), OMP_NUM_THREADS="1")
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        rec = {"engine": engine, "mode": mode, **cfg, "global_batch": args.global_batch,
               "shape": asdict(args.shape), "offload_config": args.offload_config, "wall_s": time.perf_counter() - t0}
        ranks = []
        for r in range(RANKS):
            path = os.path.join(out_dir, f"rank{r}.json")
            if os.path.exists(path):
                with open(path) as f:
                    ranks.append(json.load(f))
        if proc.returncode or len(ranks) < RANKS:
            rec["error"] = (proc.stderr or proc.stdout)[-2000:]
            return rec
    step = max(statistics.median(s["step_s"] for s in r["steps"]) for r in ranks)
    last = max(ranks, key=lambda r: r["stage"])
    rec.update(
        microbatches=ranks[0]["microbatches"], dp=ranks[0]["dp"], step_s=step,
        tokens_per_s=args.global_batch * args.shape.seq / step,
        peak_bytes=max(r["peak_bytes"] for r in ranks), offloaded_bytes=sum(r["offloaded_bytes"] for r in ranks),
        ranks=[{"rank": r["rank"], "stage": r["stage"], "peak_bytes": r["peak_bytes"], "held_bytes": r["held_bytes"],
                "offload_stats": r.get("offload_stats", {}), **common.summary(r["steps"])} for r in ranks],
        theory_bubble=bubble(cfg["stages"], ranks[0]["microbatches"], cfg["virtual"]),
        events_by_stage={str(r["stage"]): _numbered(r["events"]) for r in sorted(ranks, key=lambda r: -r["rank"])},
        losses=last["losses"], versions=ranks[0]["versions"])
    rec["fits"] = rec["peak_bytes"] <= args.budget_mib * 2**20
    return rec


def _numbered(events: list) -> list:
    """A rank's last step's events, each forward and backward numbered in its kind's order (the
    engines name micro-batches differently; 1F1B takes backwards in the forwards' order)."""
    seen = {"F": 0, "B": 0}
    out = []
    for kind, _, t0, t1 in events:
        out.append([kind, seen[kind], t0, t1])
        seen[kind] += 1
    return out


def key(rec: dict) -> tuple:
    return rec["engine"], rec["stages"], rec["virtual"], rec["micro_batch"]


def name(rec: dict) -> str:
    v = f"x{rec['virtual']}" if rec["virtual"] > 1 else ""
    return f"pp{rec['stages']}{v} dp{rec.get('dp', RANKS // rec['stages'])} mb{rec['micro_batch']} m{rec.get('microbatches', '?')}"


def report(records: list[dict], budget_mib: float) -> str:
    """The tables: every probe, then each mode's best (over the timing rounds), then the loss checks."""
    lines = []
    ok = [dict(r, fits=r["peak_bytes"] <= budget_mib * 2**20) for r in records if "error" not in r]
    for r in records:
        if "error" in r:
            lines.append(f"{r['engine']:9} {r['mode']:18} {name(r):22} ERROR {r['error'].splitlines()[-1][:120]}")
    for engine in sorted({r["engine"] for r in ok}):
        lines.append(f"\n{engine} (budget {budget_mib} MiB a rank, {ok[0]['global_batch']} sequences a step; "
                     f"versions {next(r['versions'] for r in ok if r['engine'] == engine)})")
        lines.append(f"{'mode':18} {'configuration':22} {'fits':5} {'peak MiB':>8} {'tokens/s':>9} "
                     f"{'idle by rank':>14} {'(p-1)/(m+p-1)':>13} {'offloaded MiB':>13}")
        best = {}
        for mode in common.MODES:
            runs: dict[tuple, list[dict]] = {}
            for r in ok:
                if r["engine"] == engine and r["mode"] == mode:
                    runs.setdefault(key(r), []).append(r)
            for k, rs in runs.items():
                tps = statistics.median(r["tokens_per_s"] for r in rs)
                r = rs[-1]
                idle = "/".join(f"{statistics.median(x['ranks'][i]['idle_share'] for x in rs):.2f}" for i in range(RANKS))
                lines.append(f"{mode:18} {name(r):22} {'yes' if r['fits'] else 'no':5} {r['peak_bytes'] / 2**20:8.0f} "
                             f"{tps:9.0f} {idle:>14} {r['theory_bubble']:13.2f} {r['offloaded_bytes'] / 2**20:13.0f}"
                             + (f"  ({len(rs)} runs)" if len(rs) > 1 else ""))
                if all(x["fits"] for x in rs) and (mode not in best or tps > best[mode][0]):
                    best[mode] = (tps, r)
        plain = max((best[m][0] for m in ("baseline", "recompute") if m in best), default=None)
        lines.append("best that fits:")
        for mode, (tps, r) in best.items():
            ratio = f"x{tps / plain:.3f} of the best without offloading" if plain else ""
            lines.append(f"  {mode:18} {name(r):22} {tps:9.0f} tokens/s {ratio}")
        lines.append("losses with and without offloading, same configuration:")
        for off, base in (("offload", "baseline"), ("recompute+offload", "recompute")):
            for r in ok:
                if r["engine"] == engine and r["mode"] == off:
                    twin = [b for b in ok if b["mode"] == base and key(b) == key(r)]
                    if twin:
                        same = all(b["losses"] == r["losses"] for b in twin)
                        lines.append(f"  {off} vs {base} at {name(r)}: {'equal' if same else 'DIFFER'}")
        lines += planner.beside(records, budget_mib, engine)
    return "\n".join(lines)


def _cfg(rec: dict) -> dict:
    """The configuration a record or a choice names, as ``probe`` takes it."""
    return {k: rec[k] for k in ("stages", "virtual", "micro_batch")}


def _fastest(records: list[dict]) -> dict[str, dict]:
    """Each mode's record that fits with the most tokens a second (the first of equals)."""
    best = {}
    for rec in records:
        if rec.get("fits") and rec["tokens_per_s"] > best.get(rec["mode"], {}).get("tokens_per_s", 0):
            best[rec["mode"]] = rec
    return best


def timed(best: dict, chosen: dict, modes: list[str], rounds: int,
          calibration: list[dict] = ()) -> list[list[tuple[str, dict]]]:
    """The timing rounds: in each, every mode's best from the search, and beside it the planner's
    choice where that differs, the modes alternated; first the ``calibration`` configurations
    (baseline), which give the planner its compute rates."""
    order = [("baseline", _cfg(c)) for c in calibration]
    for mode in modes:
        for rec in (best.get(mode), chosen.get(mode)):
            if rec is not None:
                cfg = _cfg(rec)
                if (mode, cfg) not in order:
                    order.append((mode, cfg))
    return [order for _ in range(rounds)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", default="megatron,deepspeed")
    p.add_argument("--modes", default=",".join(common.MODES))
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--shape", default="{}", help="the model's shape as JSON (_pipe_common.Shape's fields)")
    p.add_argument("--budget-mib", type=float, required=False, default=None, help="each rank's memory budget")
    p.add_argument("--configs", default=None,
                   help="only these configurations: 'pp2mb1,pp1mb2,pp2x2mb1' (default: every one)")
    p.add_argument("--rounds", type=int, default=3, help="timing rounds of each mode's best, modes alternated")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds a launch")
    p.add_argument("--storage", default=None, help="where the offloaded activations go (default: the temp dir)")
    p.add_argument("--offload-config", default="{}",
                   help="OffloadConfig fields for the offload modes (JSON), e.g. '{\"when_full\": \"wait\", "
                        "\"max_inflight_bytes\": 67108864}': a hard budget, at the drive's pace (default: ssdtrain's)")
    p.add_argument("--out", default=None, help="append each probe's record here (JSON lines)")
    p.add_argument("--report", default=None, help="print the tables of a finished run's --out and stop")
    p.add_argument("--searched", default=None,
                   help="an earlier run's --out: its probes stand for the search (each mode's best is chosen "
                        "from them at this --budget-mib), and only the timing rounds run")
    args = p.parse_args(argv)
    if args.report:
        with open(args.report) as f:
            records = [json.loads(line) for line in f if line.strip()]
        print(report(records, args.budget_mib or records[0].get("budget_mib")))
        return 0
    if args.budget_mib is None or args.budget_mib <= 0:
        p.error("--budget-mib: give each rank's budget in MiB (a positive number)")
    args.shape = common.Shape(**json.loads(args.shape))
    try:
        args.offload_config = json.loads(args.offload_config)
    except json.JSONDecodeError as e:
        p.error(f"--offload-config: not JSON ({e}); give OffloadConfig fields, e.g. '{{\"when_full\": \"wait\"}}'")
    if not isinstance(args.offload_config, dict):
        p.error("--offload-config: give a JSON object of OffloadConfig fields")
    engines, modes = args.engines.split(","), args.modes.split(",")
    for e in engines:
        if e not in SCRIPTS:
            p.error(f"--engines: unknown engine {e!r}; choose from {sorted(SCRIPTS)}")
    for m in modes:
        if m not in common.MODES:
            p.error(f"--modes: unknown mode {m!r}; choose from {common.MODES}")
    out = open(args.out, "a") if args.out else None
    records = []

    def run(engine, mode, cfg):
        rec = probe(engine, mode, cfg, args)
        rec["budget_mib"] = args.budget_mib
        records.append(rec)
        shown = "ERROR" if "error" in rec else (f"{'fits' if rec['fits'] else 'does not fit'}, peak "
                                                f"{rec['peak_bytes'] / 2**20:.0f} MiB, {rec['tokens_per_s']:.0f} tokens/s")
        print(f"{engine} {mode} {name(rec)}: {shown} [{rec['wall_s']:.0f} s]", flush=True)
        if out:
            out.write(json.dumps(rec) + "\n")
            out.flush()
        return rec

    earlier = []
    if args.searched:
        with open(args.searched) as f:
            earlier = [json.loads(line) for line in f if line.strip()]
    for engine in engines:
        if earlier:  # the earlier run's probes stand for the search
            searched = [dict(rec, fits=rec["peak_bytes"] <= args.budget_mib * 2**20, budget_mib=args.budget_mib)
                        for rec in earlier if rec["engine"] == engine and rec["mode"] in modes and "error" not in rec]
            records.extend(searched)
        else:
            wanted = configs(engine, args.global_batch)
            if args.configs:
                names = set(args.configs.split(","))
                wanted = [c for c in wanted
                          if f"pp{c['stages']}{'x2' if c['virtual'] > 1 else ''}mb{c['micro_batch']}" in names]
            searched = [run(engine, mode, cfg) for mode in modes for cfg in wanted]
        best = _fastest(searched)
        calibration = [c for c in configs(engine, args.global_batch) if c["stages"] == 1]
        for cfg_by_mode in timed(best, planner.choices(records, args.budget_mib, engine), modes, args.rounds,
                                 calibration):
            for mode, cfg in cfg_by_mode:
                run(engine, mode, cfg)
    print(report(records, args.budget_mib))
    return 0


if __name__ == "__main__":
    sys.exit(main())
