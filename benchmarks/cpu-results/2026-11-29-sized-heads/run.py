"""Issue 65 on the CPU: +tiled-heads sized to the layer's memory (ssdtrain.longctx.sizing; half the
64 MiB budget, the bench's default) beside recompute, recompute+offload and +tiled at the llama
max-seq search's setup (32 blocks of hidden 64, a 64 MiB budget, tiles of at least 512 tokens, at
most 4 head groups): probes one at a time, each in its own child process
(ssdtrain.bench.maxseq.run_probe), in the order given as MODE@SEQ; a MODE ending in ":fixed" runs
+tiled-heads unsized (--layer-memory 0: 4 groups, tiles of 512); blocks@SEQ measures one block's
bytes (measure_blocks) for the bound. Usage: python run.py OUT.jsonl MODE@SEQ ..."""
import dataclasses
import json
import sys
import time

from ssdtrain.bench.maxseq import MaxSeqArgs, cpu_model, describe, measure_blocks, run_probe

MODES = ("recompute", "recompute+offload", "recompute+offload+tiled", "recompute+offload+tiled-heads")
args = MaxSeqArgs(model=cpu_model("llama"), budget_bytes=64 << 20, tile_tokens=512, modes=MODES)
fixed = dataclasses.replace(args, layer_memory=0)
out = open(sys.argv[1], "a")
for item in sys.argv[2:]:
    mode, seq = item.rsplit("@", 1)
    t = time.time()
    if mode == "blocks":
        r = dict(measure_blocks(args, int(seq)), mode="blocks")
        line = json.dumps({k: v for k, v in r.items() if not k.endswith("_runs")})
    else:
        name, _, how = mode.partition(":")
        r = run_probe(fixed if how == "fixed" else args, name, int(seq))
        r["sized"] = how != "fixed" and name.endswith("+tiled-heads")
        line = describe(r) + ("" if how != "fixed" else " [unsized]")
    r["wall_s"] = time.time() - t
    print(line, f"[{r['wall_s']:.0f} s]", flush=True)
    out.write(json.dumps(r) + "\n")
    out.flush()
