"""steps.py with the cyclic collector timed (gc.callbacks): ms a step in each generation, and how
many collections. `python benchmarks/cpu-results/2026-11-30-gil/gc_time.py tier 300` from the repository root."""
import sys, time, gc
sys.argv = [sys.argv[0]] + sys.argv[1:]
t = {"s": 0.0, "n": [0, 0, 0], "t0": 0, "col": 0, "g": [0.0, 0.0, 0.0]}
def cb(phase, info):
    if phase == "start": t["t0"] = time.perf_counter()
    else:
        d = time.perf_counter() - t["t0"]; t["s"] += d; t["g"][info["generation"]] += d; t["n"][info["generation"]] += 1; t["col"] += info["collected"]
gc.callbacks.append(cb)
exec(open("benchmarks/cpu-results/2026-11-30-gil/steps.py").read())
steps = int(sys.argv[2])
print("per gen ms/step", [x / steps * 1e3 for x in t["g"]]); print("gc ms/step", t["s"] / steps * 1e3, "collections by gen", [n / steps for n in t["n"]], "collected/step", t["col"] / steps, gc.get_count(), gc.get_threshold(), len(gc.get_objects()))
