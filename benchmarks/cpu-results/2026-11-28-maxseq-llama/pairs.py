"""More alternated rounds at recompute's longest sequence than the search's two: the step of each
mode against recompute's, at the 64 MiB search's 2816 tokens (each probe a child process, as the
search runs them). Usage: python pairs.py [rounds] > pairs.txt"""
import statistics
import sys

from ssdtrain.bench.maxseq import MaxSeqArgs, cpu_model, run_probe

SEQ = 2816
MODES = ("recompute", "recompute+tiled", "recompute+offload", "recompute+offload+tiled")
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 6
args = MaxSeqArgs(model=cpu_model("llama"), budget_bytes=64 << 20, tile_tokens=256)
times = {m: [] for m in MODES}
for i in range(rounds):
    for mode in MODES if i % 2 == 0 else MODES[::-1]:
        r = run_probe(args, mode, SEQ)
        assert r["fits"], r
        times[mode].append(r["step_s"])
        print(f"round {i + 1} {mode}: {r['step_s']:.2f} s, peak {r['peak_bytes'] / 2**20:.1f} MiB", flush=True)
for mode in MODES[1:]:
    ratios = [t / b for t, b in zip(times[mode], times["recompute"])]
    print(f"{mode}: step x{statistics.median(ratios):.3f} of recompute's (median of {rounds} rounds; "
          f"each: {', '.join(f'{x:.2f}' for x in ratios)})")
