"""Issue 65 on the CPU: the +tiled-heads mode beside recompute, +tiled and +tiled-layer at the llama
max-seq search's setup (32 blocks of hidden 64, a 64 MiB budget, tiles of 512): probes one at a time,
each in its own child process (ssdtrain.bench.maxseq.run_probe), in the order given on the command
line as MODE@SEQ; blocks@SEQ measures one block's bytes (measure_blocks) for the bound.
Usage: python run.py OUT.jsonl MODE@SEQ ..."""
import json
import sys
import time

from ssdtrain.bench.maxseq import MaxSeqArgs, cpu_model, describe, measure_blocks, run_probe

MODES = ("recompute", "recompute+offload+tiled", "recompute+offload+tiled-layer", "recompute+offload+tiled-heads")
args = MaxSeqArgs(model=cpu_model("llama"), budget_bytes=64 << 20, tile_tokens=512, modes=MODES)
out = open(sys.argv[1], "a")
for item in sys.argv[2:]:
    mode, seq = item.rsplit("@", 1)
    t = time.time()
    if mode == "blocks":
        r = dict(measure_blocks(args, int(seq)), mode="blocks")
        line = json.dumps({k: v for k, v in r.items() if not k.endswith("_runs")})
    else:
        r = run_probe(args, mode, int(seq))
        line = describe(r)
    r["wall_s"] = time.time() - t
    print(line, f"[{r['wall_s']:.0f} s]", flush=True)
    out.write(json.dumps(r) + "\n")
    out.flush()
