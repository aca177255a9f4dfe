"""The TransferQueue as a Ray actor, and a driver-side handle with the same methods the loop calls.

Queue errors raised in the actor (RolloutFailedError, QueueTimeoutError, ...) reach the caller as
instances of their own class (Ray's task error subclasses the cause). The actor is threaded (`max_concurrency > 1`): a consumer blocked in `get_rollout` must not stop the
producer's `put` from arriving. Every call from the handle waits at most its timeout (the queue's own
wait timeout plus a margin for the call itself), so a dead queue actor is an error, never a hang.
Errors passed to `fail` travel as a plain `RuntimeError` with the original type and message: arbitrary
exception objects (a Ray error, say) do not always pickle.
"""

from __future__ import annotations

from typing import Any

from memrl.config import QueueConfig
from memrl.train.queue import TransferQueue

CALL_MARGIN_S = 60.0  # extra time for the remote call itself around a queue wait


class QueueActor:
    """Holds one TransferQueue; created with `ray.remote(QueueActor).options(max_concurrency=...)`."""

    def __init__(self, capacity_rows: int, data_group_size: int, timeout_s: float) -> None:
        self.queue = TransferQueue(capacity_rows, data_group_size, timeout_s)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.queue, method)(*args, **kwargs)


class RemoteQueue:
    """The driver's view of the queue actor: put, fail, finish, announce, get_rollout, get_group, stats,
    close, each a blocking call bounded by a timeout."""

    def __init__(self, queue_cfg: QueueConfig, rollout_batch_size: int, n_samples: int, rows_per_trajectory: int,
                 call_timeout_s: float) -> None:
        import ray

        local = TransferQueue.from_config(queue_cfg, rollout_batch_size, n_samples, rows_per_trajectory)  # validates
        self.timeout_s = queue_cfg.timeout_s
        self.call_timeout_s = call_timeout_s
        self.actor = ray.remote(QueueActor).options(num_cpus=0, max_concurrency=16).remote(
            local.capacity_rows, local.data_group_size, local.timeout_s)

    def _call(self, method: str, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> Any:
        from memrl.distributed.workers import wait_named

        ref = self.actor.call.remote(method, *args, **kwargs)
        return wait_named({"queue actor": ref}, timeout_s or self.call_timeout_s, f"queue.{method}",
                          reraise=True)["queue actor"]

    def put(self, rollout_id: int, rows: list[Any], train_row_count: int | None = None, final: bool = False) -> None:
        self._call("put", rollout_id, rows, train_row_count=train_row_count, final=final)

    def announce(self, rollout_id: int, train_row_count: int) -> None:
        self._call("announce", rollout_id, train_row_count)

    def finish(self, rollout_id: int) -> None:
        self._call("finish", rollout_id)

    def fail(self, rollout_id: int, error: BaseException) -> None:
        try:
            self._call("fail", rollout_id, RuntimeError(f"{type(error).__name__}: {error}"))
        except Exception:  # noqa: BLE001 - failing the rollout must never hide the error that caused it
            pass

    def get_rollout(self, rollout_id: int, timeout_s: float | None = None) -> list[Any]:
        return self._get("get_rollout", rollout_id, timeout_s or self.timeout_s)

    def get_group(self, rollout_id: int, timeout_s: float | None = None) -> list[Any] | None:
        return self._get("get_group", rollout_id, timeout_s or self.timeout_s)

    def _get(self, method: str, rollout_id: int, wait_s: float) -> Any:
        from memrl.distributed.workers import wait_named

        ref = self.actor.call.remote(method, rollout_id, timeout_s=wait_s)
        return wait_named({"queue actor": ref}, wait_s + CALL_MARGIN_S, f"queue.{method}",
                          reraise=True)["queue actor"]

    def stats(self, rollout_id: int) -> dict[str, Any]:
        return self._call("stats", rollout_id)

    def close(self) -> None:
        import ray

        try:
            self._call("close")
        except Exception:  # noqa: BLE001 - a dead queue actor is already closed; never hide the run's error
            pass
        finally:
            ray.kill(self.actor)
