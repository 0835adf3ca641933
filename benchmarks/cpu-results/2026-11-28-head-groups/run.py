"""Issue 65 on the CPU: the +tiled-heads mode at recompute's longest (step, alternated with recompute)
and at long sequences (fits?), at the llama max-seq search's setup (32 x 64, 64 MiB, tiles of 512)."""
import json, sys, time
from ssdtrain.bench.maxseq import MaxSeqArgs, cpu_model, run_probe, describe
args = MaxSeqArgs(model=cpu_model("llama"), budget_bytes=64 << 20, tile_tokens=512)
out = open(sys.argv[1], "a")
def probe(mode, seq):
    t = time.time()
    r = run_probe(args, mode, seq)
    r["wall_s"] = time.time() - t
    print(describe(r), f"[{r['wall_s']:.0f} s]", flush=True)
    out.write(json.dumps(r) + "\n"); out.flush()
    return r
plan = sys.argv[2:]
for item in plan:
    mode, seq = item.rsplit("@", 1)
    probe(mode, int(seq))
