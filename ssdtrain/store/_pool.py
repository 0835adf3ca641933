"""I/O threads and their futures, safe to drive from a thread that a Ctrl-C can interrupt.

Note [no Python-level lock on the training thread]
A KeyboardInterrupt is raised in the main thread between any two bytecodes, including inside a
context manager's ``__enter__`` written in Python, after it took its lock and before the ``with``
statement owns it (CPython gh-74174): the lock then stays held for good. The standard library's
``ThreadPoolExecutor.submit`` and every method of ``concurrent.futures.Future`` take a
``threading.Condition`` (or a ``Semaphore``, built on one) that way; a Ctrl-C landing there left
an I/O thread blocked forever on that lock, and ``close()`` joining it (found by
``benchmarks/interrupt_soak.py``). So the engine's I/O uses these instead:

* :class:`IOPool` hands work to its threads through a ``queue.SimpleQueue``, whose ``put`` is one
  call in C: a submission is either made or not.
* :class:`IOFuture` keeps its state behind a raw lock (``_thread.allocate_lock``), whose
  ``with`` entry is C code, and completes a one-way flag: ``done()`` reads it, a waiter blocks on
  a gate that completion opens. A waiter cut short between taking the gate and handing it back
  leaves it taken, but by then the flag is set, which every later waiter reads first.

They implement the part of the ``concurrent.futures`` interface the engine and the backends use;
the engine accepts a standard ``Future`` too (a custom backend's), at the old risk.
"""

from __future__ import annotations

import _thread
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import InvalidStateError
from typing import Any

__all__ = ["IOFuture", "IOPool"]

log = logging.getLogger(__name__)

_POLL = 0.05  # seconds: how often a waiter whose gate was left taken looks at the flag again


class IOFuture:
    """The result of one I/O request: ``done``, ``result``, ``exception``, ``add_done_callback``,
    and ``set_result``/``set_exception`` for the thread that completes it. Never cancelled."""

    __slots__ = ("_lock", "_gate", "_done", "_result", "_exc", "_callbacks", "__weakref__")

    def __init__(self) -> None:
        self._lock = _thread.allocate_lock()
        self._gate = _thread.allocate_lock()
        self._gate.acquire()  # opened by completion
        self._done = False
        self._result: Any = None
        self._exc: BaseException | None = None
        self._callbacks: list[Callable[[IOFuture], Any]] = []

    # -- the completing thread ----------------------------------------------------------------
    def set_running_or_notify_cancel(self) -> bool:
        return True

    def set_result(self, result: Any) -> None:
        self._complete(result, None)

    def set_exception(self, exc: BaseException) -> None:
        self._complete(None, exc)

    def _complete(self, result: Any, exc: BaseException | None) -> None:
        with self._lock:
            if self._done:
                raise InvalidStateError("this IOFuture is already done")
            self._result, self._exc = result, exc
            self._done = True  # before the gate opens: waiters read it first
            callbacks, self._callbacks = self._callbacks, []
        self._gate.release()
        for fn in callbacks:
            _call(fn, self)

    # -- any thread -----------------------------------------------------------------------------
    def done(self) -> bool:
        return self._done

    def cancelled(self) -> bool:
        return False

    def cancel(self) -> bool:
        return False

    def running(self) -> bool:
        return not self._done

    def add_done_callback(self, fn: Callable[[IOFuture], Any]) -> None:
        """Calls ``fn(self)`` on completion (on the completing thread), or now if done."""
        with self._lock:
            if not self._done:
                self._callbacks.append(fn)
                return
        _call(fn, self)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._wait(timeout)
        return self._exc

    def result(self, timeout: float | None = None) -> Any:
        self._wait(timeout)
        if self._exc is not None:
            raise self._exc
        return self._result

    def _wait(self, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._done:
            left = _POLL if deadline is None else min(_POLL, deadline - time.monotonic())
            if left <= 0:
                raise TimeoutError("the I/O request did not finish in time")
            if self._gate.acquire(timeout=left):
                self._gate.release()


def _call(fn: Callable[[IOFuture], Any], fut: IOFuture) -> None:
    try:
        fn(fut)
    except Exception:
        log.exception("ssdtrain: a completion callback raised")


class IOPool:
    """``threads`` daemon threads running submitted calls in order of submission.

    ``submit`` returns an :class:`IOFuture`; after ``shutdown`` it raises ``RuntimeError`` (as
    ``ThreadPoolExecutor`` does). Threads start with the pool.
    """

    def __init__(self, threads: int, name: str) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._threads = [threading.Thread(target=self._run, name=f"{name}_{i}", daemon=True) for i in range(threads)]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> IOFuture:
        if self._closed:
            raise RuntimeError("cannot schedule new I/O after the pool was shut down")
        fut = IOFuture()
        self._queue.put((fut, fn, args))
        return fut

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fut, fn, args = item
            del item  # nothing of a finished request (its tensors) may live while the thread waits
            try:
                result = fn(*args)
            except BaseException as exc:  # the caller sees every failure, as with an executor
                del fn, args
                fut.set_exception(exc)
                del exc
            else:
                del fn, args
                fut.set_result(result)
                del result
            del fut

    def shutdown(self, wait: bool = True) -> None:
        """Runs what was submitted, then stops the threads (joined if ``wait``). Idempotent."""
        if not self._closed:
            self._closed = True
            for _ in self._threads:
                self._queue.put(None)
        if wait:
            for t in self._threads:
                if t is not threading.current_thread():
                    t.join()
