"""Groups `perf script` output of `perf record -e sched:sched_switch --call-graph dwarf` by thread
and by the native stack where each thread went to sleep: `python sched_switch_stacks.py OUT.txt STEPS [DEPTH]`."""
import collections, re, sys
c = collections.Counter(); tids = collections.Counter()
steps = float(sys.argv[2]); depth = int(sys.argv[3]) if len(sys.argv) > 3 else 7
block = []
def flush(b):
    if not b: return
    head = b[0]
    m = re.match(r"\s*(\S+)\s+(\d+)\s", head)
    if "prev_state=S" not in head: return
    tid = m.group(2)
    syms = []
    for l in b[1:]:
        parts = l.strip().split(None, 1)
        if len(parts) < 2: continue
        s = parts[1]
        if "kernel.kallsyms" in s or "libc.so" in s: continue
        name = s.split("+")[0].split("(")[0].strip()
        if name in ("[unknown]",): continue
        syms.append(name)
    skip = ("__futex", "futex_wait", "__new_sem", "__pthread", "___pthread", "PyCOND", "lll_", "PyThread_acquire_lock_timed", "acquire_timed")
    syms = [x for x in syms if not x.startswith(skip)]
    key = " < ".join(syms[:depth])
    c[(tid, key)] += 1; tids[tid] += 1
for line in open(sys.argv[1]):
    if line.strip() == "":
        flush(block); block = []
    else:
        block.append(line.rstrip())
flush(block)
print([(t, round(n / steps, 1)) for t, n in tids.most_common(4)])
for (tid, k), n in c.most_common(25): print(f"{n/steps:5.1f}", tid, k[:260])
