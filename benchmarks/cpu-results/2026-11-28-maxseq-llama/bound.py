import json, sys
from ssdtrain.bench.maxseq import MaxSeqArgs, cpu_model, measure_blocks
args = MaxSeqArgs(model=cpu_model("llama"), budget_bytes=64 << 20, tile_tokens=int(sys.argv[1]))
for seq in map(int, sys.argv[2:]):
    r = measure_blocks(args, seq)
    print(json.dumps(r))
