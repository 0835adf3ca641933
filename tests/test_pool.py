"""The engine's I/O threads and futures (ssdtrain/store/_pool.py): Note [no Python-level lock on
the training thread]. Semantics of the futures, and what a waiter cut short leaves behind."""

import gc
import threading
import weakref

import pytest

from ssdtrain.store._pool import IOFuture, IOPool


def test_future_result_exception_and_callbacks():
    fut = IOFuture()
    seen = []
    fut.add_done_callback(lambda f: seen.append(("before", f.result())))
    assert not fut.done() and fut.running()
    with pytest.raises(TimeoutError):
        fut.result(timeout=0.01)
    fut.set_result(7)
    fut.add_done_callback(lambda f: seen.append(("after", f.result())))   # done: called at once
    assert fut.done() and fut.result() == 7 and fut.exception() is None
    assert seen == [("before", 7), ("after", 7)]
    err = IOFuture()
    err.set_exception(OSError(5, "EIO"))
    assert isinstance(err.exception(), OSError)
    with pytest.raises(OSError):
        err.result()
    with pytest.raises(Exception, match="already done"):
        err.set_result(1)


def test_a_waiter_cut_short_with_the_gate_taken_blocks_no_one():
    """The waiter's step that an interrupt can split: it took the gate and never handed it back.
    Later waiters read the completion flag first and return."""
    fut = IOFuture()
    threading.Timer(0.05, fut.set_result, ("x",)).start()
    assert fut.result(timeout=5) == "x"
    assert fut._gate.acquire(timeout=1)        # what an interrupted waiter leaves: the gate taken
    done = threading.Event()
    threading.Thread(target=lambda: (fut.result(), done.set()), daemon=True).start()
    assert done.wait(5) and fut.exception(timeout=1) is None


def test_pool_runs_in_order_forgets_finished_work_and_refuses_after_shutdown():
    pool = IOPool(1, "test-pool")
    order = []

    class Payload:
        pass

    payload = Payload()
    alive = weakref.ref(payload)
    futs = [pool.submit(order.append, i) for i in range(20)]
    last = pool.submit(lambda p: None, payload)
    del payload
    assert [f.result(timeout=5) for f in futs] == [None] * 20 and order == list(range(20))
    last.result(timeout=5)
    pool.submit(int).result(timeout=5)  # the thread has moved on to a later request
    gc.collect()
    assert alive() is None              # a finished request's arguments are not held by the thread
    boom = pool.submit(lambda: 1 / 0)
    assert isinstance(boom.exception(timeout=5), ZeroDivisionError)
    pool.shutdown()
    pool.shutdown()                     # idempotent
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(int)
    assert not any(t.is_alive() for t in pool._threads)
