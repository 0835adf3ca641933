#!/bin/bash
# OLD, NEW checkouts; OUT dir; ROUNDS; MODES
OLD=${OLD:?}; NEW=${NEW:-$PWD}; OUT=${OUT:-/tmp}; ROUNDS=${ROUNDS:-5}; MODES=${MODES:-identity,tier}
export OUT ROUNDS MODES
for r in $(seq 1 $ROUNDS); do
  (cd $OLD && PYTHONPATH=$OLD $NEW/.venv/bin/python benchmarks/pack_cost.py --rounds 1 --steps ${STEPS:-20} --modes $MODES --json $OUT/old_$r.json > /dev/null 2>&1)
  (cd $NEW && PYTHONPATH=$NEW $NEW/.venv/bin/python benchmarks/pack_cost.py --rounds 1 --steps ${STEPS:-20} --modes $MODES --json $OUT/new_$r.json > /dev/null 2>&1)
done
$NEW/.venv/bin/python - <<'PY'
import json, os, statistics
R = int(os.environ["ROUNDS"]); out = os.environ["OUT"]
for tree in ("old", "new"):
    runs = [json.load(open(f"{out}/{tree}_{r}.json")) for r in range(1, R + 1)]
    for mode in os.environ["MODES"].split(","):
        rows = [next(x for x in run["rows"] if x["mode"] == mode) for run in runs]
        med = lambda k: statistics.median(x[k] for x in rows if x.get(k) is not None) if any(x.get(k) is not None for x in rows) else 0.0
        print(f"{tree} {mode:9s} pack {med('pack_us'):5.1f} us  calls {med('pack_calls'):5.1f}  unpack {med('unpack_us'):5.1f} us"
              f"  fwd +{med('forward_extra_us_per_save'):5.1f}  all threads +{med('all_threads_extra_us_per_save'):6.1f}"
              f"  beyond copy {med('all_threads_beyond_copy_us_per_save'):6.1f}")
PY
