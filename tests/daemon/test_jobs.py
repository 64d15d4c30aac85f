"""The daemon's background job runner (lmcached/daemon/jobs.py): jobs run on named worker
threads, results come back only through `process_completions` on the caller's thread,
a stop drains or hands back what is queued."""

import threading
import time

import pytest

from lmcached.daemon.jobs import JobRunner

DEADLINE_S = 10.0


def settle(runner: JobRunner, until) -> None:
    """Apply completions, as the loop does when woken, until `until()` holds."""
    end = time.monotonic() + DEADLINE_S
    while not until():
        assert time.monotonic() < end, "the jobs did not complete"
        runner.process_completions()
        time.sleep(0.001)


def test_results_are_applied_on_the_loop_thread_in_order_and_wake_it():
    woken = threading.Semaphore(0)
    runner = JobRunner(woken.release)
    finished, threads = [], set()

    def work(jobs):
        threads.add(threading.current_thread().name)
        for job in jobs:
            queue.post(job * 10)

    def finish(results):
        assert threading.current_thread() is threading.main_thread()
        finished.extend(results)

    queue = runner.add_queue("test", work, finish)
    for job in range(50):
        assert queue.submit(job)
    assert woken.acquire(timeout=DEADLINE_S), "a posted result wakes the loop"
    settle(runner, lambda: len(finished) == 50)
    assert finished == [job * 10 for job in range(50)]
    assert threads == {"lmcached-test-0"}
    queue.stop()
    assert queue.join(time.monotonic() + DEADLINE_S) == []


def test_a_batching_take_hands_a_worker_several_jobs():
    runner = JobRunner()
    gate = threading.Event()
    batches = []

    def work(jobs):
        gate.wait(DEADLINE_S)
        batches.append(list(jobs))
        queue.post(len(jobs))

    def take(jobs):
        batch = list(jobs)
        jobs.clear()
        return batch

    queue = runner.add_queue("batch", work, lambda results: None, take=take)
    assert queue.submit(0)
    time.sleep(0.05)  # the worker holds job 0 at the gate
    for job in range(1, 5):
        queue.submit(job)
    gate.set()
    settle(runner, lambda: sum(map(len, batches)) == 5)
    assert batches == [[0], [1, 2, 3, 4]]
    queue.stop()
    queue.join()


def test_a_failing_job_is_logged_and_the_worker_goes_on(caplog):
    runner = JobRunner()
    done = []

    def work(jobs):
        if jobs[0] == "bad":
            raise RuntimeError("boom")
        queue.post(jobs[0])

    queue = runner.add_queue("flaky", work, done.extend)
    queue.submit("bad")
    queue.submit("good")
    settle(runner, lambda: done == ["good"])
    assert "background job flaky failed" in caplog.text
    queue.stop()
    queue.join()


def test_stop_without_drain_hands_back_the_queued_jobs_and_refuses_more():
    runner = JobRunner()
    gate, started = threading.Event(), threading.Event()

    def work(jobs):
        started.set()
        gate.wait(DEADLINE_S)
        queue.post(jobs[0])

    queue = runner.add_queue("undo", work, lambda results: None, max_jobs=3)
    queue.submit("running")
    assert started.wait(DEADLINE_S)
    assert [queue.submit(job) for job in "abcd"] == [True, True, True, False], "max_jobs"
    queue.stop()
    assert not queue.submit("late")
    gate.set()
    assert queue.join() == ["a", "b", "c"]
    assert queue.busy_threads() == []
    assert queue.finish_done() == 1  # the job in hand finished


def test_stop_with_drain_runs_what_is_queued_until_the_deadline():
    runner = JobRunner()
    done = []
    queue = runner.add_queue("drain", lambda jobs: queue.post(jobs[0]), done.extend,
                             num_threads=2)
    for job in range(20):
        queue.submit(job)
    queue.stop(drain=True)
    assert queue.join(time.monotonic() + DEADLINE_S) == []
    runner.process_completions()
    assert sorted(done) == list(range(20))
    runner.remove_queue(queue)
    assert runner.queues == []


def test_bad_thread_or_queue_counts_are_refused():
    with pytest.raises(ValueError, match="num_threads and max_jobs must be >= 1"):
        JobRunner().add_queue("x", lambda jobs: None, lambda results: None, num_threads=0)
