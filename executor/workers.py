"""Long-lived worker threads: one per pipeline worker, fed jobs through a queue.

A thread's first CUDA work pays library set-up (cuBLAS handles, bf16 kernels: tens of
milliseconds on an H100), so a pipeline must not start threads per iteration: its
workers live as long as the :class:`executor.pipeline.Pipeline`, as torchgpipe's do.

    workers = WorkerPool(["pipesim-worker-0", "pipesim-worker-1"])
    done = [workers.submit(w, job) for w in range(2)]   # job: a no-argument callable
    for d in done: d.result(timeout_s)                   # re-raises the job's error
    workers.close()                                      # also on garbage collection

Threads are daemons and hold no reference to the pool or the pipeline (only to their
queue), so dropping the pipeline shuts them down through ``weakref.finalize``.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

_STOP = object()


class Done:
    """The outcome of one submitted job (a minimal future)."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None

    def _finish(self, value: Any = None, error: BaseException | None = None) -> None:
        self._value, self._error = value, error
        self._event.set()

    def wait(self, timeout_s: float | None) -> bool:
        """Whether the job ended within ``timeout_s`` seconds."""
        return self._event.wait(timeout_s)

    def result(self, timeout_s: float | None = None) -> Any:
        """The job's return value; re-raises its error; ``TimeoutError`` if not done."""
        if not self._event.wait(timeout_s):
            raise TimeoutError(f"job not done after {timeout_s} s")
        if self._error is not None:
            raise self._error
        return self._value


def _serve(jobs: queue.SimpleQueue) -> None:
    while True:
        item = jobs.get()
        if item is _STOP:
            return
        fn, done = item
        try:
            done._finish(fn())
        except BaseException as exc:  # handed to whoever waits on the job
            done._finish(error=exc)
        # drop the job before waiting: it may reference its pipeline, which must stay
        # collectable between steps
        del item, fn, done


def _shutdown(queues: list[queue.SimpleQueue], threads: list[threading.Thread],
              timeout_s: float) -> None:
    for q in queues:
        q.put(_STOP)
    for t in threads:
        if t is not threading.current_thread():
            t.join(timeout_s)


class WorkerPool:
    """``len(names)`` long-lived daemon threads; job ``i`` runs on thread ``i``."""

    def __init__(self, names: Sequence[str], join_timeout_s: float = 10.0):
        self._queues: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in names]
        self.threads = [threading.Thread(target=_serve, args=(q,), name=name, daemon=True)
                        for q, name in zip(self._queues, names, strict=True)]
        for t in self.threads:
            t.start()
        self._finalizer = weakref.finalize(self, _shutdown, self._queues, self.threads,
                                           join_timeout_s)

    def submit(self, worker: int, fn: Callable[[], Any]) -> Done:
        if not self._finalizer.alive:
            raise RuntimeError("the worker pool is closed")
        done = Done()
        self._queues[worker].put((fn, done))
        return done

    def close(self) -> None:
        """Stop every thread (after its current job) and wait for them, boundedly."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive
