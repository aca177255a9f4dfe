"""TransferQueue: exact counts, capacity, timeouts and failure wake-up, with real threads."""

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


def test_count_before_rows_and_rows_from_several_producers():
    q = TransferQueue(capacity_rows=40, timeout_s=5)
    q.put(0, [], train_row_count=20)
    w = start(lambda: q.get_rollout(0))
    producers = [threading.Thread(target=lambda k=k: [q.put(0, [(k, i)]) for i in range(5)]) for k in range(4)]
    for p in producers:
        p.start()
    for p in producers:
        p.join()
    w.join(2)
    assert w.error is None and sorted(w.result) == sorted((k, i) for k in range(4) for i in range(5))


def test_overflow_names_capacity_and_config_key_and_never_drops():
    q = TransferQueue(capacity_rows=4, timeout_s=5)
    q.put(0, [1, 2, 3], train_row_count=3)
    with pytest.raises(QueueOverflowError, match=r"capacity of 4 rows.*queue\.train_sample_expansion_factor"):
        q.put(1, [1, 2], train_row_count=2)
    # rollout 0 is untouched; rollout 1 is failed, so its consumer hears about it instead of timing out
    assert q.get_rollout(0) == [1, 2, 3]
    with pytest.raises(RolloutFailedError) as info:
        q.get_rollout(1)
    assert isinstance(info.value.__cause__, QueueOverflowError)
    with pytest.raises(QueueOverflowError, match="train_row_count = 9 exceeds the queue capacity of 4"):
        q.put(2, [], train_row_count=9)


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
        q2.put(0, [], train_row_count=2)
        q2.put(0, [1], train_row_count=4)
    q3 = TransferQueue(capacity_rows=10)
    q3.put(0, [1], train_row_count=3)
    with pytest.raises(QueueError, match="final put after 2 rows, but 3 were announced"):
        q3.put(0, [2], final=True)


def test_one_to_one_path_without_count():
    q = TransferQueue(capacity_rows=8, timeout_s=5)
    w = start(lambda: q.get_rollout(0))
    q.put(0, ["a", "b"])
    q.put(0, ["c"])
    time.sleep(0.1)
    assert w.is_alive(), "without a count the consumer must wait for the final put"
    q.put(0, [], final=True)
    w.join(2)
    assert w.result == ["a", "b", "c"]
    q.put(1, ["x"], final=True)
    assert q.get_rollout(1) == ["x"]
    with pytest.raises(QueueError, match="already finished"):
        q.put(1, ["y"])
    q.put(2, [], final=True)  # a 1:1 rollout may end with no rows at all
    assert q.get_rollout(2) == []


def test_timeout_names_rollout_and_counts():
    q = TransferQueue(capacity_rows=8, timeout_s=0.2)
    q.put(7, [1, 2], train_row_count=5)
    t0 = time.monotonic()
    with pytest.raises(QueueTimeoutError, match=r"rollout 7.*received 2 rows so far, expected 5"):
        q.get_rollout(7)
    assert 0.2 <= time.monotonic() - t0 < 2.0
    default = TransferQueue(capacity_rows=8, timeout_s=0.2)
    with pytest.raises(QueueTimeoutError, match="received 0 rows so far, expected not yet announced"):
        default.get_rollout(1)
    # rows survive a consumer timeout: a retry still gets them
    q.put(7, [3, 4, 5])
    assert q.get_rollout(7) == [1, 2, 3, 4, 5]


def test_fail_wakes_waiter_with_original_error_in_under_a_second():
    q = TransferQueue(capacity_rows=8, timeout_s=30)
    q.put(4, [1], train_row_count=4)
    w = start(lambda: q.get_rollout(4))
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
        q.get_rollout(1)


def test_from_config_capacity_and_validation():
    cfg = QueueConfig(train_sample_expansion_factor=5, timeout_s=12.0)
    q = TransferQueue.from_config(cfg, rollout_batch_size=4, n_samples=3, rows_per_trajectory=5)
    assert (q.capacity_rows, q.timeout_s) == (60, 12.0)
    with pytest.raises(QueueError, match="capacity_rows must be > 0"):
        TransferQueue(capacity_rows=0)


def test_the_queue_offers_what_the_loop_uses():
    # Issue 25: announce / finish / get_group / iter_groups (and queue.train_data_group_size) served tests
    # only; the loop counts in put, ends a 1:1 rollout with put(final=True) and takes whole rollouts.
    public = {name for name in vars(TransferQueue) if not name.startswith("_")}
    assert public == {"from_config", "put", "fail", "close", "get_rollout", "stats"}


@pytest.mark.parametrize("timeout", [float("nan"), float("inf"), -1.0, 0, True, "5"])
def test_non_finite_or_non_positive_timeouts_are_rejected(timeout):
    # A NaN timeout made get_rollout wait forever; an infinite one raised OverflowError from the wait.
    with pytest.raises(QueueError, match=r"timeout_s \(queue.timeout_s\) must be a finite number of seconds > 0"):
        TransferQueue(capacity_rows=4, timeout_s=timeout)


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
        q.put(1, [], train_row_count=count)


@pytest.mark.parametrize("bad", [dict(capacity_rows="8"), dict(capacity_rows=8.0), dict(capacity_rows=True)])
def test_sizes_must_be_ints(bad):
    with pytest.raises(QueueError, match="must be an int"):
        TransferQueue(**{"capacity_rows": 8, **bad})


def test_rollout_ids_and_final_are_checked_not_coerced():
    q = TransferQueue(capacity_rows=8, timeout_s=5)
    # "3" and 3 would be two rollouts: the consumer of 3 would time out while rows sit under "3".
    for call in (lambda: q.put("3", ["a"]), lambda: q.put(True, [], train_row_count=2), lambda: q.get_rollout(1.0),
                 lambda: q.fail("3", RuntimeError()), lambda: q.stats("3")):
        with pytest.raises(QueueError, match="rollout_id must be an int"):
            call()
    with pytest.raises(QueueError, match="final must be True or False"):
        q.put(3, ["a"], final="yes")
    assert q.stats(3)["rows_put"] == 0 and held(q) == 0


def test_late_put_on_a_consumed_rollout_raises_and_leaves_its_stats():
    q = TransferQueue(capacity_rows=8, timeout_s=5)
    q.put(0, [1, 2, 3, 4], train_row_count=4)
    assert q.get_rollout(0) == [1, 2, 3, 4]
    consumed = q.stats(0)
    assert consumed["status"] == "consumed"
    for late in (lambda: q.put(0, [5, 6]), lambda: q.put(0, []), lambda: q.put(0, [], train_row_count=4),
                 lambda: q.put(0, [], final=True)):
        with pytest.raises(QueueError, match="already consumed"):
            late()
    q.fail(0, RuntimeError("a late failure report"))  # must not rewrite a step that was trained on
    assert q.stats(0) == consumed and held(q) == 0


def test_rollout_finished_empty_before_any_consumer_still_rejects_puts_as_finished():
    q = TransferQueue(capacity_rows=8, timeout_s=5)
    q.put(0, [], final=True)
    with pytest.raises(QueueError, match="already finished"):
        q.put(0, ["a"])
    q.fail(1, RuntimeError("boom"))  # a rollout nobody consumed still fails as before
    assert q.stats(1)["status"] == "failed"


def test_an_empty_rollout_is_complete_until_taken_and_taken_once():
    # A 1:1 rollout whose every group was dropped finishes with no rows: nobody has trained on it yet,
    # so it reads "complete" (not "consumed") until the loop takes it, and a second take is refused.
    q = TransferQueue(capacity_rows=8, timeout_s=5)
    q.put(0, [], final=True)
    assert q.stats(0)["status"] == "complete"
    assert q.get_rollout(0) == []
    assert q.stats(0)["status"] == "consumed"
    with pytest.raises(QueueError, match="already consumed"):
        q.get_rollout(0)
