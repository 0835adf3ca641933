"""The modelled GPU against the GPU runs on record: each recorded figure beside the model's.

Every row runs the engine's GPU path, unchanged, on a modelled GPU without data
(``ssdtrain.bench.modelled``), at the recorded run's shape, with that machine's measured rates:
the H200 preset (``ssdtrain/device/rates.py``: 788 TFLOP/s, 4.3 TB/s, 54.5 GB/s each way) and
the pack hook's 29 us a save measured on that host (``gpu_overhead.py``, same session); 5 us a
kernel launch (the preset's estimate). Recorded figures: ``benchmarks/RESULTS.md`` (H200, 2026-11-27, calls 10 and 11;
the tier at 22:10) and ``docs/results.md`` (the 32-block search under a 6 GiB cap, 20:56).
Tolerance (issue 63): 10 points of a share, 5% of a step ratio; a row outside it says which
effect the model lacks.

    python benchmarks/model_vs_recorded.py [--json F]     # about 2 minutes on 2 cores

The table in docs/results.md (11 of 14 within tolerance) was made at commit 1e932fe, with the
engine those GPU runs had. The fence change after it (Note [a copy is due when its fence is])
removes a wait the recorded runs had: on today's code the model gives offload x1.003 and
recompute+offload x1.069, out of tolerance against those records by design, until a GPU
measures the new code.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

from ssdtrain.bench.models import GPTConfig
from ssdtrain.bench.modelled import ModelledArgs, max_seq_modelled, run_modelled, sim_rates

GiB, MiB = 1 << 30, 1 << 20
BENCH = GPTConfig(vocab=32768, seq=2048, layers=12, hidden=2048, heads=16)
"""tier_vs_peers.py's shape (the bench's GPU preset), batch 4, bf16."""
DEEP = GPTConfig(vocab=32768, seq=2048, layers=32, hidden=1024, heads=8, loss_chunk=4096)
"""The 32-block max-seq search's shape (``.ci/gpu-check maxseq``), batch 1, bf16."""
PACK_S = 29e-6  # gpu_overhead.py, H200, 2026-11-27: 9.3 ms of pack over 325 saves


def h200_rates():
    """The H200 preset with the pack cost measured on its host; 5 us a launch (the preset's
    estimate: call 10's host forward, 15.9 ms, was slowed by a cuBLAS variable, docs/results.md)."""
    return sim_rates("sim:h200", pack_s=PACK_S)


def unpaced(off) -> None:
    """tier_vs_peers.py's diagnostic: the host's pacing off (Note [the host paces the copies])."""
    if off._tier is not None:
        off._tier.clock._pace = lambda *_: None


def bench_rows(rates) -> list[dict]:
    args = ModelledArgs(device="sim:h200", model=BENCH, batch=4, steps=3, rates=rates)
    res = {r["mode"]: r for r in run_modelled(args)["rows"]}
    res["unpaced"] = run_modelled(dataclasses.replace(args, modes=("recompute+offload",), configure=unpaced))["rows"][0]
    base, rec, off, ro, un = (res[k] for k in ("baseline", "recompute", "offload", "recompute+offload", "unpaced"))
    above = lambda r: r["peak_bytes"] - r["start_bytes"]  # noqa: E731 (tier_vs_peers.py's peak)
    bound = min(rates.d2h_bytes_per_s * base["forward"], off["unique"])
    inputs = BENCH.layers * 4 * BENCH.seq * BENCH.hidden * 2  # the block inputs, bf16
    return [
        {"row": "offload: step vs baseline (22:10)", "recorded": 1.060, "modelled": off["seconds"] / base["seconds"],
         "kind": "ratio"},
        {"row": "offload: peak's fall / copy bound (22:10)", "recorded": 0.75,
         "modelled": (above(base) - above(off)) / bound, "kind": "share"},
        {"row": "recompute+offload: step vs recompute (22:10)", "recorded": 1.067,
         "modelled": ro["seconds"] / rec["seconds"], "kind": "ratio"},
        {"row": "recompute+offload: block inputs off the GPU (22:10)", "recorded": 1.0,
         "modelled": (above(rec) - above(ro)) / inputs, "kind": "share"},
        {"row": "recompute vs baseline (call 10)", "recorded": 1.255, "modelled": rec["seconds"] / base["seconds"],
         "kind": "ratio"},
        {"row": "unpaced recompute+offload vs recompute, due at hand-over (call 11)", "recorded": 1.147,
         "modelled": un["seconds"] / rec["seconds"], "kind": "ratio"},
        {"row": "unpaced: block inputs off the GPU (call 11)", "recorded": 1.00,
         "modelled": (above(rec) - above(un)) / inputs, "kind": "share"},
    ]


def deep_rows(rates) -> list[dict]:
    cap = 6 * GiB
    args = ModelledArgs(device="sim:h200", model=DEEP, batch=1, seq=24576, steps=2, rates=rates,
                        modes=("recompute", "recompute+offload"))
    res = {r["mode"]: r for r in run_modelled(args)["rows"]}
    rec, ro = res["recompute"], res["recompute+offload"]
    longest = {m: max_seq_modelled(args, m, cap, start=8192) for m in ("recompute", "recompute+offload")}
    r, o = longest["recompute"]["seq"], longest["recompute+offload"]["seq"]
    peaks = {m: run_modelled(dataclasses.replace(args, seq=s, modes=(m,), rates=sim_rates(
        "sim:h200", cap, pack_s=PACK_S)))["rows"][0]["peak_bytes"] for m, s in (("recompute", 24576),
                                                                            ("recompute+offload", 49152))}
    return [
        {"row": "peak at 24576, recompute: 5989 MiB (20:56)", "recorded": 5989 * MiB,
         "modelled": peaks["recompute"], "kind": "ratio"},
        {"row": "peak at 49152, recompute+offload: 5689 MiB (20:56)", "recorded": 5689 * MiB,
         "modelled": peaks["recompute+offload"], "kind": "ratio"},
        {"row": "24576 tokens, 32 x 1024: recompute+offload step vs recompute (20:56)", "recorded": 1.00,
         "modelled": ro["seconds"] / rec["seconds"], "kind": "ratio"},
        {"row": "24576 tokens: saves in host memory, 1577 of 1633 MiB (20:56)", "recorded": 1577 / 1633,
         "modelled": ro["copied"] / ro["unique"], "kind": "share"},
        {"row": f"6 GiB cap: recompute's longest (recorded 24576; modelled {r})", "recorded": 24576, "modelled": r,
         "kind": "seq"},
        {"row": f"6 GiB cap: recompute+offload's longest (recorded 49152; modelled {o})", "recorded": 49152,
         "modelled": o, "kind": "seq"},
        {"row": "6 GiB cap: longest, recompute+offload / recompute (20:56)", "recorded": 2.00,
         "modelled": (o or 0) / r if r else float("nan"), "kind": "ratio"},
    ]


def within(row: dict) -> bool:
    rec, mod = row["recorded"], row["modelled"]
    if mod is None:
        return False
    if row["kind"] == "share":
        return abs(mod - rec) <= 0.10
    if row["kind"] == "seq":
        return abs(mod / rec - 1) <= 1 / 8  # the search's own step: an eighth of the last doubling
    return abs(mod / rec - 1) <= 0.05


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json")
    ns = ap.parse_args(argv)
    t0 = time.perf_counter()
    rates = h200_rates()
    print(f"modelled H200: host {rates.launch_s * 1e6:.1f} us a launch, pack {PACK_S * 1e6:.0f} us a save, copy issue "
          f"{rates.copy_issue_s * 1e6:.0f} us", flush=True)
    rows = bench_rows(rates) + deep_rows(rates)
    fmt = lambda r, v: (f"{v:.0%}" if r["kind"] == "share" else str(v) if r["kind"] == "seq"  # noqa: E731
                        else f"{v / MiB:.0f} MiB" if v > 1000 else f"x{v:.3f}")
    print(f"\n| {'figure':<72} | recorded | modelled | within |\n| --- | --- | --- | --- |")
    for r in rows:
        r["within"] = within(r)
        print(f"| {r['row']:<72} | {fmt(r, r['recorded'])} | {fmt(r, r['modelled'])} | "
              f"{'yes' if r['within'] else 'NO'} |")
    print(f"\n{sum(r['within'] for r in rows)} of {len(rows)} within tolerance; {time.perf_counter() - t0:.0f} s")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"rates": dataclasses.asdict(rates), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
