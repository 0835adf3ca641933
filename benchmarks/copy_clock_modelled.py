"""The host tier's copies when step lengths change, on the full modelled GPU (issue 63, item 3).

``copy_clock_lengths.py`` drives the engine's ``CopyClock`` alone on a timeline model; this runs
the whole engine (the offloader, its tier, the clock as the hooks feed it, the stream-ordered
releases) on the modelled H100 without data (``ssdtrain.bench.modelled``): a GPT of hidden 4096
(32 heads, bf16, batch 1, the loss in chunks of 4096 tokens), checkpointed per block, trained by
``recompute+offload`` and by ``recompute`` through the same steps of changing length. For each
step: the peak's fall (recompute's peak above its start, less recompute+offload's) over its own
bound, ``min(D2H rate x recompute's forward, the checkpoints' bytes)``, and the step against
recompute's at the same step.

    python benchmarks/copy_clock_modelled.py [--layers 8] [--json F]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

from ssdtrain.bench.models import GPTConfig
from ssdtrain.bench.modelled import ModelledArgs, _mode_steps, sim_rates

K = 1024
SCHEDULES = {
    "cycle 1k 8k 2k 16k 4k": (1 * K, 1 * K, 1 * K) + (1 * K, 8 * K, 2 * K, 16 * K, 4 * K) * 2,
    "16k after 50 x 1k": (1 * K,) * 50 + (16 * K, 16 * K),
    "steady 8k": (8 * K,) * 6,
}
WARM = 3  # the first steps learn (everything copied, then a reference forward that copies nothing)


def run(layers: int) -> dict:
    cfg = GPTConfig(vocab=32768, seq=2048, layers=layers, hidden=4096, heads=32, loss_chunk=4096)
    rates = sim_rates("sim:h100")
    out = {}
    for name, seqs in SCHEDULES.items():
        args = ModelledArgs(device="sim:h100", model=cfg, batch=1, seqs=seqs, steps=len(seqs) - 1)
        rec = _mode_steps("recompute", args)
        off = _mode_steps("recompute+offload", args)
        rows = []
        for i, (r, o) in enumerate(zip(rec, off)):
            bound = min(rates.d2h_bytes_per_s * r["forward"], o["unique"])
            fall = (r["peak_bytes"] - r["start_bytes"]) - (o["peak_bytes"] - o["start_bytes"])
            off_gpu = o["copied"] + o["spilled"]
            rows.append({"step": i, "seq": o["seq"], "share": off_gpu / bound if bound else None, "fall": fall,
                         "ratio": o["seconds"] / r["seconds"], "copied": o["copied"], "spilled": o["spilled"],
                         "bound": bound})
        after = [row for row in rows if row["step"] >= WARM]
        out[name] = {"rows": rows, "lowest_share": min(row["share"] for row in after),
                     "highest_ratio": max(row["ratio"] for row in after)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--json")
    ns = ap.parse_args(argv)
    t0 = time.perf_counter()
    res = run(ns.layers)
    for name, r in res.items():
        print(f"{name}: lowest share after step {WARM} {r['lowest_share']:.0%}, highest step ratio "
              f"x{r['highest_ratio']:.3f}")
        shown = r["rows"] if len(r["rows"]) <= 16 else r["rows"][:4] + r["rows"][-4:]
        for row in shown:
            print(f"   step {row['step']:>2} seq {row['seq']:>6}: off the GPU {row['share']:5.0%} of its bound "
                  f"({row['bound'] / 2**30:.2f} GiB; {row['spilled'] / 2**20:.0f} MiB of it spilled), "
                  f"peak's fall {row['fall'] / 2**20:.0f} MiB, "
                  f"step x{row['ratio']:.3f} of recompute's")
    print(f"({time.perf_counter() - t0:.0f} s; modelled H100, {ns.layers} blocks of hidden 4096)")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
