"""The distillation teacher in a Ray actor of its own, on runs whose student trains on Ray ranks.

The actor loads the teacher once (in ``teacher.precision``) and answers each step's top-k pass over the
whole batch: the driver sends the batch's tokens and gets ``[B, T, k]`` logprobs and ids back, never a
vocabulary-wide tensor. On a cluster with GPUs the actor holds one GPU of
its own beside the training ranks' (a cluster without a free one is refused at start-up, saying so); on
CPUs it reserves no CPU, since it computes while the trainer waits for it. An actor that dies during a pass
is started again and the pass re-sent once; a second death ends the run with the reason.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import ray
import ray.exceptions
import torch

from rlfleet.algorithms.distillation.teacher import Teacher
from rlfleet.errors import UserError
from rlfleet.models.loading import ModelSource
from rlfleet.policy.batch import TrainBatch
from rlfleet.policy.microbatch import MicroBatching

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 900.0  # scheduling the actor and loading the teacher (a large one on a cold node)


class _TeacherActor:
    """Runs in the Ray actor: the teacher, on the actor's GPU when it holds one."""

    def __init__(self, source: ModelSource, temperature: float) -> None:
        self.teacher = Teacher(source, temperature)

    def ready(self) -> tuple[int, str]:
        return os.getpid(), str(self.teacher.device)

    def topk(
        self, batch: TrainBatch, micro_batching: MicroBatching | int, k: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.teacher.topk(batch, micro_batching, k)


class RayTeacher:
    """The driver's handle on the teacher's actor (Ray must be initialised)."""

    def __init__(
        self, source: ModelSource, temperature: float, num_gpus: int, startup_timeout_s: float
    ) -> None:
        self.source, self.temperature = source, temperature
        self.num_gpus, self.startup_timeout_s = num_gpus, startup_timeout_s
        self._remote = ray.remote(_TeacherActor).options(
            num_cpus=0, num_gpus=num_gpus, max_restarts=0, max_task_retries=0
        )
        self.num_restarts = 0
        self._actor: Any = None
        self._start()

    @classmethod
    def start(
        cls, source: ModelSource, temperature: float = 1.0, startup_timeout_s: float = STARTUP_TIMEOUT_S
    ) -> RayTeacher:
        """The teacher's actor (its top-k at ``temperature``), with one GPU when the cluster has GPUs.

        Raises:
            UserError: No GPU free for it, or it did not start within ``startup_timeout_s``.
        """
        if not ray.is_initialized():
            raise RuntimeError("RayTeacher needs Ray initialised first (the policy's workers start it)")
        num_gpus = 1 if ray.cluster_resources().get("GPU", 0.0) > 0 else 0  # CPU clusters: CPU workers
        free = ray.available_resources().get("GPU", 0.0)
        if num_gpus > free:
            raise UserError(
                f"the distillation teacher takes a GPU of its own beside the training ranks', but the Ray "
                f"cluster has {free:g} GPU(s) free once the policy has started; fix: a cluster with a free "
                "GPU for it (one more than cluster.gpus_per_node x cluster.num_nodes uses)"
            )
        return cls(source, temperature, num_gpus, startup_timeout_s)

    def _start(self) -> None:
        self._actor = self._remote.remote(self.source, self.temperature)
        try:
            pid, device = ray.get(self._actor.ready.remote(), timeout=self.startup_timeout_s)
        except ray.exceptions.GetTimeoutError:
            ray.kill(self._actor, no_restart=True)
            raise UserError(
                f"the distillation teacher's Ray actor did not start within {self.startup_timeout_s:.0f} s; "
                f"the cluster may lack a free {'GPU' if self.num_gpus else 'slot'} for it, or the teacher "
                "loads slowly; fix: free resources for it"
            ) from None
        except ray.exceptions.RayTaskError as exc:  # the constructor raised: its own error, unwrapped
            ray.kill(self._actor, no_restart=True)
            raise exc.as_instanceof_cause() from None
        log.info("distillation teacher runs in Ray actor pid %d on %s", pid, device)

    def topk(
        self, batch: TrainBatch, micro_batching: MicroBatching | int, k: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        for attempt in (1, 2):
            try:
                result: tuple[torch.Tensor, torch.Tensor] = ray.get(
                    self._actor.topk.remote(batch, micro_batching, k)
                )
                return result
            except ray.exceptions.RayActorError as exc:
                if attempt == 2:
                    raise UserError(
                        f"the distillation teacher's Ray actor died twice in one step ({str(exc)[:300]}); "
                        "fix: see its log (out of memory?); rerun the same command to resume"
                    ) from exc
                log.error("distillation teacher: its actor died (%s); starting it again", str(exc)[:300])
                ray.kill(self._actor, no_restart=True)
                self._start()
                self.num_restarts += 1
        raise AssertionError("unreachable")

    def close(self) -> None:
        """Kills the actor (idempotent)."""
        actor, self._actor = self._actor, None
        if actor is not None and ray.is_initialized():
            ray.kill(actor, no_restart=True)
