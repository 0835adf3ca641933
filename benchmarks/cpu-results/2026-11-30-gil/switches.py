"""steps.py, then each thread's voluntary and involuntary context switches a step (/proc/<pid>/task).
`python benchmarks/cpu-results/2026-11-30-gil/switches.py tier 300` from the repository root."""
import sys, threading, os
exec(open("benchmarks/cpu-results/2026-11-30-gil/steps.py").read().replace("    if off: off.close()", """    names = {t.native_id: t.name for t in threading.enumerate()}
    for tid in os.listdir(f"/proc/{os.getpid()}/task"):
        st = dict(l.split(":\\t") for l in open(f"/proc/{os.getpid()}/task/{tid}/status").read().splitlines() if ":\\t" in l)
        print(names.get(int(tid), tid), "vol", int(st["voluntary_ctxt_switches"]) / steps, "invol", int(st["nonvoluntary_ctxt_switches"]) / steps)
    if off: off.close()"""))
