"""The daemon's background jobs: named worker threads, job queues, completions for the loop.

Why this file exists: the loop (`server.py`) is one thread and must never wait for a
copy or the network, yet demotions copy device memory and the L2 tier talks to Redis.
Every such user hands jobs to worker threads here and gets their results back on the
loop thread, the only one that changes block metadata. After Redis's `bio.c`: one job
type per queue, named threads, and one way back (a completion queue the loop drains
after a wake-up), so that a third user (a disk tier) is a queue, not a third copy::

    loop thread                       worker threads (JobQueue "demotion", "l2-write", ...)
    queue.submit(job) --------------> take(jobs) -> work(jobs) -> queue.post(result)
                                                                       |
    runner.process_completions() <--- wake() (the loop's wake-up socket) <+
      -> finish(results) per queue, in the order the queues were added

Shutdown (`JobQueue.stop` then `JobQueue.join`): a worker finishes the job in hand; a
queue stopped with `drain=True` lets its workers take what is queued until it is empty
or the deadline passes; what is still queued then is handed back to the owner, which
undoes or counts it.
"""

import collections
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from lmcached.wire.logger import init_logger

logger = init_logger(__name__)

J = TypeVar("J")  # a job
R = TypeVar("R")  # a result handed back to the loop


def take_one(jobs: collections.deque) -> list:
    """The default `take`: the oldest job alone."""
    return [jobs.popleft()]


class JobQueue(Generic[J, R]):
    """One type of background job and the threads that run it (made by `JobRunner.add_queue`).

    Args:
        runner: the runner whose completions the results join.
        name: the threads' name prefix (`lmcached-<name>-<i>`).
        work: runs on a worker thread with the jobs `take` returned; hands results to
            the loop with `post`. An exception is logged and the thread goes on.
        finish: runs on the loop thread with every result posted since the last call.
        num_threads: worker threads (>= 1).
        max_jobs: jobs queued at most (`submit` refuses more); None: the owner bounds
            its queue itself (by bytes, by jobs in flight).
        take: pops the next jobs from the queue (a non-empty deque) under its lock; the
            oldest alone by default, a batch for a pipelined writer.

    Raises:
        ValueError: num_threads < 1 or max_jobs < 1.
    """

    def __init__(self, runner: "JobRunner", name: str, work: Callable[[list[J]], None],
                 finish: Callable[[list[R]], None], *, num_threads: int = 1,
                 max_jobs: int | None = None,
                 take: Callable[[collections.deque], list[J]] = take_one) -> None:
        if num_threads < 1 or (max_jobs is not None and max_jobs < 1):
            raise ValueError(f"job queue {name!r}: num_threads and max_jobs must be >= 1")
        self.name = name
        self._runner = runner
        self._work = work
        self.finish = finish
        self.max_jobs = max_jobs
        self._take = take
        self._jobs: collections.deque[J] = collections.deque()
        self.done: collections.deque[R] = collections.deque()  # appended by workers
        self._cv = threading.Condition(threading.Lock())
        self._stopping = False
        self._drain = False
        self._threads = [threading.Thread(target=self._run, name=f"lmcached-{name}-{i}",
                                          daemon=True) for i in range(num_threads)]
        for thread in self._threads:
            thread.start()

    @property
    def stopping(self) -> bool:
        """True once `stop` was called (a long job checks it to end early)."""
        return self._stopping

    def __len__(self) -> int:
        """Jobs queued and not taken by a worker yet."""
        return len(self._jobs)

    def submit(self, job: J) -> bool:
        """Queue a job and wake a worker (loop thread). False, and nothing queued, when
        `max_jobs` are queued or the queue is stopping."""
        with self._cv:
            if self._stopping or (self.max_jobs is not None and len(self._jobs) >= self.max_jobs):
                return False
            self._jobs.append(job)
            self._cv.notify()
        return True

    def post(self, result: R) -> None:
        """Hand a result to the loop and wake it (any thread)."""
        self.done.append(result)  # deque.append is atomic
        self._runner.wake()

    def stop(self, drain: bool = False) -> None:
        """Tell the workers to stop after the job in hand (with `drain`, after the jobs
        queued); `submit` refuses from now on."""
        with self._cv:
            self._stopping = True
            self._drain = drain
            self._cv.notify_all()

    def join(self, deadline: float | None = None) -> list[J]:
        """Wait for the workers (until `deadline`, time.monotonic() seconds; None: no
        limit), then empty the queue.

        Returns:
            The jobs no worker took, oldest first, for the owner to undo or count.
        """
        for thread in self._threads:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        with self._cv:
            left = list(self._jobs)
            self._jobs.clear()
        return left

    def finish_done(self) -> int:
        """Apply the results posted so far with `finish` (loop thread); how many."""
        done = self.done
        if not done:
            return 0
        results = []
        while done:
            results.append(done.popleft())
        self.finish(results)
        return len(results)

    def busy_threads(self) -> list[str]:
        """Names of the workers still running (after `join` with a deadline)."""
        return [t.name for t in self._threads if t.is_alive()]

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._jobs and not self._stopping:
                    self._cv.wait()
                if self._stopping and not (self._drain and self._jobs):
                    return
                jobs = self._take(self._jobs)
            try:
                self._work(jobs)
            except Exception:  # noqa: BLE001 - a worker never dies
                logger.exception("background job %s failed", self.name)


class JobRunner:
    """The daemon's background job queues and their one way back to the loop.

    Args:
        wake: wakes the loop thread from any thread (the server's wake-up socket); the
            loop then calls `process_completions`. A test without a loop passes nothing
            and calls `process_completions` itself.
    """

    def __init__(self, wake: Callable[[], None] = lambda: None) -> None:
        self.wake = wake
        self.queues: list[JobQueue] = []

    def add_queue(self, name: str, work: Callable[[list[J]], None],
                  finish: Callable[[list[R]], None], **options) -> JobQueue[J, R]:
        """A new job queue and its started threads (see `JobQueue` for the arguments)."""
        queue = JobQueue(self, name, work, finish, **options)
        self.queues.append(queue)
        return queue

    def remove_queue(self, queue: JobQueue) -> None:
        """Forget a queue its owner stopped and joined (its completions were finished)."""
        self.queues.remove(queue)

    def process_completions(self) -> int:
        """Apply what the workers finished: each queue's `finish` with its results, in
        the order the queues were added (loop thread).

        Returns:
            How many results were applied.
        """
        return sum(queue.finish_done() for queue in list(self.queues))
