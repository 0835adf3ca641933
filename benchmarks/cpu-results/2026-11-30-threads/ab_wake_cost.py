"""Of the tier's copy-thread cost, how much is the wake-up itself: batches made inline on the
submitting thread (a bound), against the same plus a wake of a C thread that never takes the GIL
(what a C copy worker would still pay), against the threads. Not a design: a measurement.
Build first (from the repository root): gcc -O2 -shared -fPIC -o /tmp/wk/libwaker.so
benchmarks/cpu-results/2026-11-30-threads/waker.c -lpthread; then
`python benchmarks/cpu-results/2026-11-30-threads/ab_wake_cost.py ROUNDS`."""
import ctypes, sys
sys.path.insert(0, "benchmarks")
import pack_cost
from ssdtrain.host import tier
from ssdtrain.store._pool import IOFuture
lib = ctypes.CDLL(sys.argv[2] if len(sys.argv) > 2 else "/tmp/wk/libwaker.so")
orig = tier._Batches.submit
def inline_submit(self, requests, wake=False):
    fut = IOFuture()
    if wake:
        lib.poke()
    try:
        self._process(requests)
    except BaseException as e:
        fut.set_exception(e)
        return fut
    fut.set_result(None)
    return fut
def inline(off): tier._Batches.submit = inline_submit
def inline_wake(off): tier._Batches.submit = lambda self, r: inline_submit(self, r, True)
def threads(off): tier._Batches.submit = orig
pack_cost.alternate({"inline": inline, "inline+wake": inline_wake, "threads": threads}, int(sys.argv[1]) if len(sys.argv) > 1 else 7)
