"""A measurement, not a design: the tier's CPU batches handed to a copy thread in C that makes the
memmoves without the GIL and takes it once afterwards for the batch's completion (the futures and
their callbacks, as the Python copy thread runs them); the batch's addresses are read on the
submitting thread. Against the Python copy threads, and against the batches made inline (the
bound). Build first (from the repository root):
gcc -O2 -shared -fPIC -I$(python -c "import sysconfig; print(sysconfig.get_paths()['include'])")
-o /tmp/wk/cworker_gil$(python -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
benchmarks/cpu-results/2026-11-30-threads/cworker_gil.c -lpthread; then
`python benchmarks/cpu-results/2026-11-30-threads/ab_c_worker.py ROUNDS`."""
import sys
sys.path.insert(0, "benchmarks")
sys.path.insert(0, "/tmp/wk")
import cworker_gil
import pack_cost
from ssdtrain.host import tier
from ssdtrain.store._pool import IOFuture

orig = tier._Batches.submit
workers = {}


def c_submit(self, requests):
    fut = IOFuture()
    process = self._process
    backend, name = process.__self__, process.__name__
    pool = backend.pool
    for _, _, ready in requests:
        if ready is not None:
            ready()
    if name == "_copy_in":
        triples = [(pool.address(ext), src.data_ptr(), ext.nbytes) for ext, src, _ in requests]
    else:
        triples = [(dst.data_ptr(), pool.address(ext), ext.nbytes) for ext, dst, _ in requests]

    def done():
        n = sum(ext.nbytes for ext, _, _ in requests)
        with backend._lock:
            if name == "_copy_in":
                for ext, _, _ in requests:
                    ext.landed = None
                backend.copied += n
            else:
                backend.read += n
        fut.set_result(None)
    key = (id(backend), name)
    if key not in workers:
        workers[key] = cworker_gil.Worker()
    workers[key].submit(triples, done)
    return fut


def inline_submit(self, requests):
    fut = IOFuture()
    self._process(requests)
    fut.set_result(None)
    return fut


def use(fn):
    def setup(off):
        tier._Batches.submit = fn
    return setup


pack_cost.alternate({"C worker": use(c_submit), "threads": use(orig), "inline": use(inline_submit)},
                    int(sys.argv[1]) if len(sys.argv) > 1 else 7)
