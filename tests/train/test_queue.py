"""TransferQueue: exact counts, groups, capacity, timeouts and failure wake-up, with real threads."""

from __future__ import annotations

import threading
import time

import pytest

from memrl.config import QueueConfig
from memrl.train.queue import (
    QueueClosedError,
    QueueError,
    QueueOverflowError,
    QueueTimeoutError,
    RolloutFailedError,
    TransferQueue,
)


def held(q: TransferQueue) -> int:
    """Rows counted against the queue's capacity (put, not yet taken), over all rollout ids."""
    return q._held


class Waiter(threading.Thread):
    """Runs `fn` in a thread and records its result or exception and when it returned."""

    def __init__(self, fn):
        super().__init__(daemon=True)
        self.fn, self.result, self.error, self.done_at = fn, None, None, None

    def run(self):
        try:
            self.result = self.fn()
        except BaseException as e:  # noqa: BLE001 - the test inspects whatever was raised
            self.error = e
        self.done_at = time.monotonic()


def start(fn) -> Waiter:
    w = Waiter(fn)
    w.start()
    return w


def test_consumer_waits_for_exact_announced_count():
    q = TransferQueue(capacity_rows=16, timeout_s=5)
    w = start(lambda: q.get_rollout(3))
    q.put(3, ["a", "b"], train_row_count=5)
    q.put(3, ["c"])
    time.sleep(0.1)
    assert w.is_alive(), "consumer returned before the announced count arrived"
    q.put(3, ["d", "e"])
    w.join(2)
    assert w.error is None and w.result == ["a", "b", "c", "d", "e"]
    assert q.stats(3) == {"rows_put": 5, "rows_taken": 5, "expected": 5, "held": 0, "status": "consumed"}


def test_announce_before_put_and_rows_from_several_producers():
    q = TransferQueue(capacity_rows=40, timeout_s=5)
    q.announce(0, 20)
    w = start(lambda: q.get_rollout(0))
    producers = [threading.Thread(target=lambda k=k: [q.put(0, [(k, i)]) for i in range(5)]) for k in range(4)]
    for p in producers:
        p.start()
    for p in producers:
        p.join()
    w.join(2)
    assert w.error is None and sorted(w.result) == sorted((k, i) for k in range(4) for i in range(5))


def test_groups_are_handed_out_as_soon_as_complete():
    q = TransferQueue(capacity_rows=12, data_group_size=3, timeout_s=5)
    q.put(1, [0, 1], train_row_count=6)
    groups: list = []
    got_first = threading.Event()

    def consume():
        for g in q.iter_groups(1):
            groups.append(g)
            got_first.set()
        return groups

    w = start(consume)
    time.sleep(0.1)
    assert groups == [], "a group of 3 was handed out with 2 rows"
    q.put(1, [2, 3])
    assert got_first.wait(2) and groups == [[0, 1, 2]]
    assert held(q) == 1  # the handed-out group's capacity is released at once
    q.put(1, [4, 5])
    w.join(2)
    assert w.error is None and groups == [[0, 1, 2], [3, 4, 5]]
    assert q.stats(1)["rows_taken"] == 6 and q.stats(1)["status"] == "consumed"


def test_count_must_divide_by_group_size():
    q = TransferQueue(capacity_rows=12, data_group_size=4)
    with pytest.raises(QueueError, match="multiple of queue.train_data_group_size = 4"):
        q.announce(0, 6)
    q.put(1, [1, 2, 3])
    with pytest.raises(QueueError, match="3 rows, not a multiple"):
        q.finish(1)


def test_overflow_names_capacity_and_config_key_and_never_drops():
    q = TransferQueue(capacity_rows=4, timeout_s=5)
    q.put(0, [1, 2, 3], train_row_count=3)
    with pytest.raises(QueueOverflowError, match=r"capacity of 4 rows.*queue\.train_sample_expansion_factor"):
        q.put(1, [1, 2], train_row_count=2)
    # rollout 0 is untouched; rollout 1 is failed, so its consumer hears about it instead of timing out
    assert q.get_rollout(0) == [1, 2, 3]
    with pytest.raises(RolloutFailedError) as info:
        q.get_rollout(1, timeout_s=0.5)
    assert isinstance(info.value.__cause__, QueueOverflowError)
    with pytest.raises(QueueOverflowError, match="train_row_count = 9 exceeds the queue capacity of 4"):
        q.announce(2, 9)


def test_over_count_names_both_numbers_and_wakes_consumer():
    q = TransferQueue(capacity_rows=10, timeout_s=5)
    w = start(lambda: q.get_rollout(0))
    q.put(0, [1, 2], train_row_count=3)
    with pytest.raises(QueueError, match=r"putting 2 rows after 2 exceeds the announced train_row_count = 3"):
        q.put(0, [3, 4])
    w.join(1)
    assert isinstance(w.error, RolloutFailedError) and "train_row_count = 3" in str(w.error)
    assert held(q) == 0
    with pytest.raises(QueueError, match="differs"):
        q2 = TransferQueue(capacity_rows=10)
        q2.announce(0, 2)
        q2.put(0, [1], train_row_count=4)


def test_one_to_one_path_without_count():
    q = TransferQueue(capacity_rows=8, timeout_s=5)
    w = start(lambda: q.get_rollout(0))
    q.put(0, ["a", "b"])
    q.put(0, ["c"])
    time.sleep(0.1)
    assert w.is_alive(), "without a count the consumer must wait for finish()"
    q.finish(0)
    w.join(2)
    assert w.result == ["a", "b", "c"]
    q.put(1, ["x"], final=True)
    assert q.get_rollout(1) == ["x"]
    with pytest.raises(QueueError, match="already finished"):
        q.put(1, ["y"])
    q.finish(2)  # a 1:1 rollout may end with no rows at all
    assert list(q.iter_groups(2, timeout_s=0.5)) == []


def test_one_to_one_groups_end_at_finish():
    q = TransferQueue(capacity_rows=8, data_group_size=2, timeout_s=5)
    q.put(0, [1, 2, 3, 4])
    w = start(lambda: list(q.iter_groups(0)))
    time.sleep(0.1)
    assert w.is_alive(), "iteration must not end before finish()"
    q.finish(0)
    w.join(2)
    assert w.error is None and w.result == [[1, 2], [3, 4]]


def test_timeout_names_rollout_and_counts():
    q = TransferQueue(capacity_rows=8, timeout_s=60)
    q.put(7, [1, 2], train_row_count=5)
    t0 = time.monotonic()
    with pytest.raises(QueueTimeoutError, match=r"rollout 7.*received 2 rows so far, expected 5"):
        q.get_rollout(7, timeout_s=0.2)
    assert 0.2 <= time.monotonic() - t0 < 2.0
    default = TransferQueue(capacity_rows=8, timeout_s=0.2)
    with pytest.raises(QueueTimeoutError, match="received 0 rows so far, expected not yet announced"):
        next(default.iter_groups(1))
    # rows survive a consumer timeout: a retry still gets them
    q.put(7, [3, 4, 5])
    assert q.get_rollout(7, timeout_s=1) == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("how", ["get_rollout", "iter_groups"])
def test_fail_wakes_waiter_with_original_error_in_under_a_second(how):
    q = TransferQueue(capacity_rows=8, timeout_s=30)
    q.put(4, [1], train_row_count=4)
    fn = (lambda: q.get_rollout(4)) if how == "get_rollout" else (lambda: list(q.iter_groups(4)))
    w = start(fn)
    time.sleep(0.05)
    cause = ValueError("converter broke on trajectory q3-s1")
    failed_at = time.monotonic()
    q.fail(4, cause)
    w.join(5)
    assert isinstance(w.error, RolloutFailedError) and w.error.__cause__ is cause
    assert "converter broke" in str(w.error)
    assert w.done_at - failed_at < 1.0
    assert held(q) == 0 and q.stats(4)["status"] == "failed"
    with pytest.raises(RolloutFailedError):
        q.put(4, [2])


def test_fail_before_consumer_arrives_raises_at_once():
    q = TransferQueue(capacity_rows=8, timeout_s=30)
    q.fail(9, RuntimeError("rollout worker died"))
    t0 = time.monotonic()
    with pytest.raises(RolloutFailedError, match="rollout worker died"):
        q.get_rollout(9)
    assert time.monotonic() - t0 < 1.0


def test_close_wakes_every_waiter():
    q = TransferQueue(capacity_rows=8, timeout_s=30)
    waiters = [start(lambda i=i: q.get_rollout(i)) for i in range(3)]
    waiters.append(start(lambda: list(q.iter_groups(5))))
    time.sleep(0.05)
    closed_at = time.monotonic()
    q.close()
    for w in waiters:
        w.join(5)
        assert isinstance(w.error, QueueClosedError)
        assert w.done_at - closed_at < 1.0
    with pytest.raises(QueueClosedError):
        q.put(0, [1])


def test_capacity_released_after_get():
    q = TransferQueue(capacity_rows=4, timeout_s=5)
    q.put(0, [1, 2, 3, 4], train_row_count=4)
    assert held(q) == 4
    assert q.get_rollout(0) == [1, 2, 3, 4]
    assert held(q) == 0
    q.put(1, [5, 6, 7, 8], train_row_count=4)  # would overflow had capacity not been released
    assert q.get_rollout(1) == [5, 6, 7, 8]
    with pytest.raises(QueueError, match="already consumed"):
        q.get_rollout(1, timeout_s=0.1)


def test_one_way_of_taking_rows_per_rollout():
    q = TransferQueue(capacity_rows=4, data_group_size=2, timeout_s=5)
    q.put(0, [1, 2, 3, 4], train_row_count=4)
    assert q.get_group(0) == [1, 2]
    with pytest.raises(QueueError, match="one way of taking rows"):
        q.get_rollout(0)


def test_from_config_capacity_and_validation():
    cfg = QueueConfig(train_sample_expansion_factor=5, train_data_group_size=2, timeout_s=12.0)
    q = TransferQueue.from_config(cfg, rollout_batch_size=4, n_samples=3, rows_per_trajectory=5)
    assert (q.capacity_rows, q.data_group_size, q.timeout_s) == (60, 2, 12.0)
    with pytest.raises(QueueError, match="data_group_size"):
        TransferQueue(capacity_rows=4, data_group_size=0)
    with pytest.raises(QueueError, match="below data_group_size"):
        TransferQueue(capacity_rows=2, data_group_size=4)


@pytest.mark.parametrize("timeout", [float("nan"), float("inf"), -1.0, 0, True, "5"])
def test_non_finite_or_non_positive_timeouts_are_rejected_at_construction_and_per_call(timeout):
    # A NaN timeout made get_rollout wait forever; an infinite one raised OverflowError from the wait.
    with pytest.raises(QueueError, match=r"timeout_s \(queue.timeout_s\) must be a finite number of seconds > 0"):
        TransferQueue(capacity_rows=4, timeout_s=timeout)
    q = TransferQueue(capacity_rows=4, timeout_s=5)
    for call in (lambda: q.get_rollout(0, timeout_s=timeout), lambda: q.get_group(1, timeout_s=timeout),
                 lambda: list(q.iter_groups(2, timeout_s=timeout))):
        w = start(call)
        w.join(2)
        assert not w.is_alive() and isinstance(w.error, QueueError), w.error
        assert "must be a finite number of seconds > 0" in str(w.error)


@pytest.mark.parametrize("count", ["4", 4.0, True, [4]])
def test_a_count_that_is_not_an_int_is_a_queue_error_that_wakes_the_consumer(count):
    q = TransferQueue(capacity_rows=8, timeout_s=5)
    w = start(lambda: q.get_rollout(0))
    time.sleep(0.05)
    with pytest.raises(QueueError, match=r"train_row_count must be an int, got"):
        q.put(0, ["a"], train_row_count=count)
    w.join(2)
    assert isinstance(w.error, RolloutFailedError) and "must be an int" in str(w.error)
    with pytest.raises(QueueError, match="train_row_count must be an int"):
        q.announce(1, count)


@pytest.mark.parametrize("bad", [dict(capacity_rows="8"), dict(capacity_rows=8.0), dict(data_group_size=True)])
def test_sizes_must_be_ints(bad):
    with pytest.raises(QueueError, match="must be an int"):
        TransferQueue(**{"capacity_rows": 8, **bad})


def test_rollout_ids_and_final_are_checked_not_coerced():
    q = TransferQueue(capacity_rows=8, timeout_s=5)
    # "3" and 3 would be two rollouts: the consumer of 3 would time out while rows sit under "3".
    for call in (lambda: q.put("3", ["a"]), lambda: q.announce(True, 2), lambda: q.get_rollout(1.0),
                 lambda: q.fail("3", RuntimeError()), lambda: q.stats("3")):
        with pytest.raises(QueueError, match="rollout_id must be an int"):
            call()
    with pytest.raises(QueueError, match="final must be True or False"):
        q.put(3, ["a"], final="yes")
    assert q.stats(3)["rows_put"] == 0 and held(q) == 0


@pytest.mark.parametrize("mode", ["all", "groups"])
def test_late_put_on_a_consumed_rollout_raises_and_leaves_its_stats(mode):
    q = TransferQueue(capacity_rows=8, data_group_size=2, timeout_s=5)
    q.put(0, [1, 2, 3, 4], train_row_count=4)
    assert (q.get_rollout(0) if mode == "all" else sum(q.iter_groups(0), [])) == [1, 2, 3, 4]
    consumed = q.stats(0)
    assert consumed["status"] == "consumed"
    for late in (lambda: q.put(0, [5, 6]), lambda: q.put(0, []), lambda: q.announce(0, 4),
                 lambda: q.finish(0)):
        with pytest.raises(QueueError, match="already consumed"):
            late()
    q.fail(0, RuntimeError("a late failure report"))  # must not rewrite a step that was trained on
    assert q.stats(0) == consumed and held(q) == 0


def test_rollout_finished_empty_before_any_consumer_still_rejects_puts_as_finished():
    q = TransferQueue(capacity_rows=8, timeout_s=5)
    q.finish(0)
    with pytest.raises(QueueError, match="already finished"):
        q.put(0, ["a"])
    q.fail(1, RuntimeError("boom"))  # a rollout nobody consumed still fails as before
    assert q.stats(1)["status"] == "failed"
