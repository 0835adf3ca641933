#!/bin/bash
# old (2a03dc6) vs new (HEAD) pack cost, alternated rounds; the same benchmark file in both trees
# OLD: a checkout of the old tree with this benchmarks/pack_cost.py copied in; NEW: this checkout; OUT: a directory
# The figures in docs/results.md (2026-11-28) were taken with pack_cost.py of commit 9955aa4 (torch's default
# intra-op threads, two here); the file now measures with one unless --intra-op-threads 0.
OLD=${OLD:?}; NEW=${NEW:-$PWD}; OUT=${OUT:-/tmp}; export OUT
cd "$OUT"
for r in 1 2 3; do
  (cd $OLD && PYTHONPATH=$OLD $NEW/.venv/bin/python benchmarks/pack_cost.py --rounds 1 --steps 20 --modes identity,kept,tier,drive --json $OUT/old_$r.json > /dev/null 2>&1)
  (cd $NEW && PYTHONPATH=$NEW $NEW/.venv/bin/python benchmarks/pack_cost.py --rounds 1 --steps 20 --modes identity,kept,tier,drive --json $OUT/new_$r.json > /dev/null 2>&1)
done
OUT=$OUT $NEW/.venv/bin/python - <<'PY'
import json, os, statistics
for tree in ("old", "new"):
    runs = [json.load(open(f"{os.environ['OUT']}/{tree}_{r}.json")) for r in (1, 2, 3)]
    for mode in ("identity", "kept", "tier", "drive"):
        rows = [next(x for x in run["rows"] if x["mode"] == mode) for run in runs]
        med = lambda k: statistics.median(x[k] for x in rows if x.get(k) is not None) if any(x.get(k) is not None for x in rows) else float("nan")
        print(f"{tree} {mode:9s} pack {med('pack_us'):5.1f} us  calls {med('pack_calls'):5.1f}  unpack {med('unpack_us'):5.1f} us"
              f"  fwd +{med('forward_extra_us_per_save') if mode!='identity' else 0:5.1f} us/save  all threads +{med('all_threads_extra_us_per_save') if mode!='identity' else 0:6.1f}"
              f"  beyond copy {med('all_threads_beyond_copy_us_per_save') if mode!='identity' else 0:6.1f}  memcpy {statistics.median(r['memcpy_bps'] for r in runs)/1e9:.2f} GB/s")
PY
