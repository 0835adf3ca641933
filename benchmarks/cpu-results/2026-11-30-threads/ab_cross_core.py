"""What a copy made on another core costs beyond the wake: the tier's batches made inline on the
submitting thread, their memmoves on the training thread (plus a wake of an idle C thread), against
the memmoves handed to a C thread on the other core and waited for (no GIL taken there), against the
threads. Not a design: a measurement of what a C copy worker could still pay.
Build first (from the repository root): gcc -O2 -shared -fPIC -o /tmp/wk/libcworker.so
benchmarks/cpu-results/2026-11-30-threads/cworker.c -lpthread and libwaker.so from waker.c; then
`python benchmarks/cpu-results/2026-11-30-threads/ab_cross_core.py ROUNDS`."""
import ctypes, sys
sys.path.insert(0, "benchmarks")
import pack_cost
from ssdtrain.device import copies
from ssdtrain.host import tier
from ssdtrain.store._pool import IOFuture
waker = ctypes.CDLL("/tmp/wk/libwaker.so")
worker = ctypes.CDLL("/tmp/wk/libcworker.so")
worker.copy_on_worker.argtypes = [ctypes.c_void_p, ctypes.c_long]
orig_submit, orig_copy = tier._Batches.submit, copies.copy_host
def on_worker(triples):
    n = len(triples)
    arr = (ctypes.c_uint64 * (3 * n))(*[x for t in triples for x in t])
    worker.copy_on_worker(arr, n)
def inline_submit(self, requests):
    fut = IOFuture()
    try:
        self._process(requests)
    except BaseException as e:
        fut.set_exception(e)
        return fut
    fut.set_result(None)
    return fut
def inline_wake(off):
    tier._Batches.submit = lambda self, r: (waker.poke(), inline_submit(self, r))[1]
    copies.copy_host = orig_copy
def inline_worker(off):
    tier._Batches.submit = inline_submit
    copies.copy_host = on_worker
def threads(off):
    tier._Batches.submit = orig_submit
    copies.copy_host = orig_copy
pack_cost.alternate({"inline+wake": inline_wake, "inline, copy on C thread": inline_worker, "threads": threads},
                    int(sys.argv[1]) if len(sys.argv) > 1 else 7)
