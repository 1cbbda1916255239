"""The tokenizing pool ends as its workers do: a closed pool is waited for, not terminated.
Pool.terminate() right after close() sent SIGTERM to workers taking their sentinels from the task
queue, and one killed while holding the queue's lock left the next blocked on it for ever (seen
once in a real job: the preparer hung in Pool.join while every rank waited for it)."""

from __future__ import annotations

import multiprocessing

from jobgen.train.encode import _end_pool


def test_a_closed_pools_workers_end_by_themselves_not_by_sigterm():
    for _ in range(20):  # the old terminate() hit a worker in 1 of 5 tries here
        pool = multiprocessing.get_context("fork").Pool(2)
        assert pool.apply_async(sum, ([1, 2],)).get(10) == 3
        workers = list(pool._pool)
        pool.close()
        _end_pool(pool, closed=True)
        assert [worker.exitcode for worker in workers] == [0, 0]  # -15 when terminate() ended them


def test_a_pool_left_early_is_terminated():
    pool = multiprocessing.get_context("fork").Pool(2)
    pool.apply_async(sum, ([1, 2],))
    workers = list(pool._pool)
    _end_pool(pool, closed=False)
    assert all(worker.exitcode is not None for worker in workers)
