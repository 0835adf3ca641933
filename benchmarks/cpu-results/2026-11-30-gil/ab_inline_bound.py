"""Upper bound of what taking the copy threads' wake-ups out could give: the tier's batches made
inline on the submitting thread (no thread woken), against the threads. Not a design: a bound."""
import sys
sys.path.insert(0, "benchmarks")
import pack_cost
from ssdtrain.host import tier
from ssdtrain.store._pool import IOFuture
orig = tier._Batches.submit
def inline_submit(self, requests):
    fut = IOFuture()
    try:
        self._process(requests)
    except BaseException as e:
        fut.set_exception(e)
        return fut
    fut.set_result(None)
    return fut
def inline(off): tier._Batches.submit = inline_submit
def threads(off): tier._Batches.submit = orig
pack_cost.alternate({"inline": inline, "threads": threads}, int(sys.argv[1]) if len(sys.argv) > 1 else 7)
