"""A measurement, not a design: the tier's CPU batches handed to a copy thread in C that makes the
memmoves without the GIL and never takes it; the training thread collects the finished batches
(their futures and callbacks) where it already asks about the write queue (``pack_pumps``), at
unpack, in ``heal`` and while it waits for a read. Against the Python copy threads and the batches
made inline. Build first (from the repository root):
gcc -O2 -shared -fPIC -I$(python -c "import sysconfig; print(sysconfig.get_paths()['include'])")
-o /tmp/wk/cworker_poll$(python -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
benchmarks/cpu-results/2026-11-30-threads/cworker_poll.c -lpthread; then
`python benchmarks/cpu-results/2026-11-30-threads/ab_c_worker_polled.py ROUNDS`."""
import itertools, sys, time
sys.path.insert(0, "benchmarks")
sys.path.insert(0, "/tmp/wk")
import cworker_poll
import pack_cost
from ssdtrain.engine import unpack, writer
from ssdtrain.host import tier
from ssdtrain.store._pool import IOFuture

workers, pending, ids = {}, {}, itertools.count(1)
ON = [False]


def poll_all():
    for w in workers.values():
        for i in w.poll():
            pending.pop(i)()


class Polled(IOFuture):
    __slots__ = ("worker",)

    def _wait(self, timeout):
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._done:
            poll_all()
            if self._done:
                return
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError
            self.worker.wait(0.05)


def c_submit(self, requests):
    fut = Polled()
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
        workers[key] = cworker_poll.Worker()
    fut.worker = workers[key]
    i = next(ids)
    pending[i] = done
    workers[key].submit(triples, i)
    return fut


orig_submit, orig_pumps = tier._Batches.submit, writer.WriteQueue.pack_pumps.fget
orig_unpack, orig_heal = unpack.UnpackHooks._unpack, writer.WriteQueue.heal


def pumps(self):
    if ON[0]:
        poll_all()
    return orig_pumps(self)


def unpack_(self, ref):
    if ON[0]:
        poll_all()
    return orig_unpack(self, ref)


def heal(self):
    if ON[0]:
        poll_all()
    return orig_heal(self)


writer.WriteQueue.pack_pumps = property(pumps)
unpack.UnpackHooks._unpack = unpack_
writer.WriteQueue.heal = heal


def inline_submit(self, requests):
    fut = IOFuture()
    self._process(requests)
    fut.set_result(None)
    return fut


def use(fn, on):
    def setup(off):
        tier._Batches.submit = fn
        ON[0] = on
    return setup


pack_cost.alternate({"C polled": use(c_submit, True), "threads": use(orig_submit, False),
                     "inline": use(inline_submit, False)}, int(sys.argv[1]) if len(sys.argv) > 1 else 7)
