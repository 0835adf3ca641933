#!/bin/bash
# usage: ab.sh OLD_DIR NEW_DIR N MODES
old=$1; new=$2; n=$3; modes=${4:-identity,tier,kept}
for i in $(seq $n); do
  for d in $old $new; do
    (cd $d && PYTHONPATH=$d timeout 600 python benchmarks/pack_cost.py --modes $modes --rounds 2 --json /tmp/ab_$(basename $d)_$i.json >/dev/null 2>&1)
  done
done
python - "$old" "$new" "$n" <<'PY'
import json,sys,statistics,os
old,new,n=sys.argv[1],sys.argv[2],int(sys.argv[3])
for d in (old,new):
    rows={}
    for i in range(1,n+1):
        for r in json.load(open(f"/tmp/ab_{os.path.basename(d)}_{i}.json"))["rows"]:
            for k in ("pack_us","unpack_us","pack_calls","forward_extra_us_per_save","backward_extra_us_per_save","forward_all_threads_extra_us_per_save"):
                if k in r: rows.setdefault((r["mode"],k),[]).append(r[k])
    print(d, {f"{m}.{k}": round(statistics.median(v),1) for (m,k),v in rows.items()})
PY
