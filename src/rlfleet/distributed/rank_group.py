"""A group of Ray actors, one per placement-group bundle, joined in one ``torch.distributed`` process group.

Each actor hosts an instance of a plain per-rank class (for example ``ShardedPolicyRank``). The host
limits torch to one thread, joins the process group (gloo on CPU, NCCL with CUDA) and only then builds the
worker, so that a worker may run collectives (FSDP sharding) in its constructor.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import ray
import ray.exceptions
import torch
import torch.distributed as dist
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

logger = logging.getLogger(__name__)


class RankDiedError(RuntimeError):
    """A worker actor died (crashed, was killed or lost its node)."""

    def __init__(self, rank: int, cause: BaseException) -> None:
        super().__init__(
            f"worker rank {rank} died ({type(cause).__name__}: {cause}); the process group is broken: "
            "shut the group down and start a new one (check the rank's log for an out-of-memory kill)"
        )
        self.rank = rank


class RankTimeoutError(TimeoutError):
    """Some ranks did not answer a call within the group's timeout."""


class _RankHost:
    """Runs inside one Ray actor: joins the process group, then hosts the per-rank worker."""

    def __init__(self, rank: int, world_size: int) -> None:
        torch.set_num_threads(1)
        self.rank = rank
        self.world_size = world_size
        self.worker: Any = None

    def address_and_free_port(self) -> tuple[str, int]:
        """This node's IP and a TCP port free on it (for rank 0's rendezvous)."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", 0))
            port = int(sock.getsockname()[1])
        return ray.util.get_node_ip_address(), port

    def init_process_group(self, master_addr: str, master_port: int, timeout_s: float) -> str:
        """Joins the group; returns the backend used."""
        os.environ.update(
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK="0",  # Ray gives each actor its own CUDA_VISIBLE_DEVICES, so the device is cuda:0
        )
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(0)
        dist.init_process_group(
            backend, rank=self.rank, world_size=self.world_size, timeout=timedelta(seconds=timeout_s)
        )
        return backend

    def construct(self, actor_cls: type, init_args: Mapping[str, Any]) -> None:
        """Builds this rank's worker (after the process group exists, so it may run collectives)."""
        self.worker = actor_cls(**init_args)

    def call(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Runs ``worker.method(*args, **kwargs)``."""
        if self.worker is None:
            raise RuntimeError(f"rank {self.rank} has no worker yet; the group's constructor did not finish")
        return getattr(self.worker, method)(*args, **kwargs)

    def close(self) -> None:
        """Closes the worker (when it has a ``close``: a vLLM engine's process), then leaves the group."""
        worker, self.worker = self.worker, None
        if worker is not None and hasattr(worker, "close"):
            worker.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def gather(refs: Sequence[ray.ObjectRef], timeout_s: float) -> list[Any]:
    """``ray.get`` in order, failing as soon as any call fails (rather than waiting on a blocked peer).

    Raises:
        RankDiedError: The actor behind a call died (its index in ``refs`` is named as the rank).
        RankTimeoutError: Some calls did not finish within ``timeout_s``.
    """
    rank_of = {ref: rank for rank, ref in enumerate(refs)}
    results: dict[int, Any] = {}
    pending = list(refs)
    deadline = time.monotonic() + timeout_s
    while pending:
        remaining = deadline - time.monotonic()
        done, pending = ray.wait(pending, num_returns=1, timeout=max(remaining, 0.0))
        if not done:
            ranks = sorted(rank_of[r] for r in pending)
            raise RankTimeoutError(
                f"ranks {ranks} did not answer within {timeout_s:.0f}s; a peer may be stuck in a "
                "collective: inspect their logs, raise cluster.call_timeout_s, or shut the group down"
            )
        for ref in done:
            try:
                results[rank_of[ref]] = ray.get(ref, timeout=max(deadline - time.monotonic(), 1.0))
            except ray.exceptions.RayActorError as exc:
                raise RankDiedError(rank_of[ref], exc) from exc
    return [results[rank] for rank in range(len(refs))]


class RayRankGroup:
    """One actor per bundle of ``placement_groups`` (ranks in order), each hosting ``actor_cls(**init_args)``.

    Args:
        actor_cls: A plain per-rank class, importable (or pickled by value) on the workers.
        placement_groups: Ready placement groups, one per node (see ``create_node_placement_groups``).
        init_args: Keyword arguments of ``actor_cls``; the same on every rank.
        timeout_s: Limit on every call to the actors (constructing, ``run_all``), in seconds.
    """

    def __init__(
        self,
        actor_cls: type,
        placement_groups: Sequence[PlacementGroup],
        init_args: Mapping[str, Any],
        timeout_s: float,
    ) -> None:
        self.timeout_s = timeout_s
        slots = [(pg, i) for pg in placement_groups for i in range(pg.bundle_count)]
        self.world_size = len(slots)
        remote_host = ray.remote(_RankHost)
        self.actors: list[ray.actor.ActorHandle] = [
            remote_host.options(
                num_cpus=1,
                num_gpus=pg.bundle_specs[i].get("GPU", 0),  # the whole bundle's GPUs
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
            ).remote(rank, self.world_size)
            for rank, (pg, i) in enumerate(slots)
        ]
        try:
            self._start(actor_cls, init_args)
        except BaseException:
            self.shutdown()
            raise

    def _start(self, actor_cls: type, init_args: Mapping[str, Any]) -> None:
        master_addr, master_port = self._gather([self.actors[0].address_and_free_port.remote()])[0]
        self.master = f"{master_addr}:{master_port}"
        backends = self._gather(
            [a.init_process_group.remote(master_addr, master_port, self.timeout_s) for a in self.actors]
        )
        logger.info("process group of %d ranks (%s) at %s", self.world_size, backends[0], self.master)
        self._gather([a.construct.remote(actor_cls, dict(init_args)) for a in self.actors])

    def run_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Calls ``method(*args, **kwargs)`` on every rank's worker; returns the results in rank order.

        Raises:
            RankDiedError: A rank's actor died.
            RankTimeoutError: Some ranks did not finish within the group's timeout.
        """
        return self._gather(self.submit(method, *args, **kwargs))

    def run_on(
        self, ranks: Sequence[int], method: str, per_rank_args: Sequence[tuple[Any, ...]]
    ) -> list[Any]:
        """Calls ``method(*per_rank_args[i])`` on rank ``ranks[i]``; results in that order."""
        if len(per_rank_args) != len(ranks):
            raise ValueError(f"{len(per_rank_args)} argument tuples for {len(ranks)} ranks")
        return self._gather(
            [self.submit_to(rank, method, *args) for rank, args in zip(ranks, per_rank_args, strict=True)]
        )

    def submit(self, method: str, *args: Any, **kwargs: Any) -> list[ray.ObjectRef]:
        """Starts ``method`` on every rank without waiting (gather with ``gather``)."""
        return [a.call.remote(method, args, kwargs) for a in self.actors]

    def submit_to(self, rank: int, method: str, *args: Any, **kwargs: Any) -> ray.ObjectRef:
        """Starts ``method`` on one rank without waiting."""
        return self.actors[rank].call.remote(method, args, kwargs)

    def free_port_on_rank0(self) -> tuple[str, int]:
        """Rank 0's node address and a port free there (for another group's rendezvous)."""
        address: tuple[str, int] = self._gather([self.actors[0].address_and_free_port.remote()])[0]
        return address

    def _gather(self, refs: list[ray.ObjectRef]) -> list[Any]:
        return gather(refs, self.timeout_s)

    def shutdown(self) -> None:
        """Destroys the process group in every live actor and kills the actors."""
        closing = [a.close.remote() for a in self.actors]
        _, not_closed = ray.wait(closing, num_returns=len(closing), timeout=min(self.timeout_s, 10.0))
        if not_closed:
            logger.warning("%d worker(s) did not close their process group; killing them", len(not_closed))
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []
