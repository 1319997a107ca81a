"""Pools of worker processes (or Ray actors) that call one function on a batch of items, each item within a
wall-clock bound, a stuck or dead worker replaced: reward functions (:meth:`WorkerPool.score`) and environment
steps (:class:`~rlfleet.environments.runner.PooledRunner`) run in them.
"""

from __future__ import annotations

from rlfleet.pools.process_pool import PoolResult, ProcessWorkerPool, RewardBatch, WorkerPool

__all__ = ["PoolResult", "ProcessWorkerPool", "RewardBatch", "WorkerPool"]
