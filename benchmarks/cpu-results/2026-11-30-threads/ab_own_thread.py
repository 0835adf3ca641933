"""In one process: the tier's batches handed to a thread of their own woken by one token (no
IOPool request, no drain future a batch) against the landed _Batches on an IOPool. A prototype."""
import sys, queue, threading, _thread
sys.path.insert(0, "benchmarks")
import pack_cost
from ssdtrain.host import tier
from ssdtrain.store._pool import IOFuture

class Own:
    def __init__(self, name, process):
        self._process = process
        self._lock = _thread.allocate_lock()
        self._pending = []
        self._idle = True
        self._q = queue.SimpleQueue()
        self.pool = self
        threading.Thread(target=self._run, name=name, daemon=True).start()
    def submit(self, requests):
        fut = IOFuture()
        with self._lock:
            self._pending.append((requests, fut))
            if self._idle:
                self._q.put(1)
                self._idle = False
        return fut
    def shutdown(self, wait=True):
        self._q.put(None)
    def _run(self):
        while self._q.get() is not None:
            while True:
                with self._lock:
                    batch, self._pending = self._pending, []
                    if not batch:
                        self._idle = True
                        break
                try:
                    self._process([r for requests, _ in batch for r in requests])
                except BaseException as e:
                    for _, fut in batch:
                        fut.set_exception(e)
                    continue
                for _, fut in batch:
                    fut.set_result(None)

def own(off):
    t = off._tier
    t._ins, t._outs = Own("own-d2h", t._copy_in), Own("own-h2d", t._copy_out)
def landed(off): pass
pack_cost.alternate({"own": own, "landed": landed}, int(sys.argv[1]) if len(sys.argv) > 1 else 7)
