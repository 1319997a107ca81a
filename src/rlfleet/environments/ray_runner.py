"""An environment stepped in a Ray actor of its own: where the environments that score with a model
(``reward_model``, ``judge``) run when the run is on Ray, as NeMo RL gives its reward model a worker.

The actor builds the environment once (its model loads there, on the actor's GPU when
``env.<name>.resources.gpus_per_node=1``) and steps a whole step's batch at once, with the trainer-side
runner's semantics (:class:`~rlfleet.environments.runner.InProcessRunner`): a batch that fails is stepped one
item at a time, so only the bad items cost (reward 0, counted in ``train/reward_errors``).

An actor that dies mid-step (killed, out of memory, its node lost) is started again and the step re-sent
once; if that fails too, the step's items count as errors (reward 0) and the run goes on. An actor that
cannot start (no free GPU on the cluster, a model that does not load) ends the run at start-up, saying why.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import ray
import ray.exceptions

from rlfleet.environments.interface import EnvironmentInterface, EnvironmentReturn, MessageLog
from rlfleet.environments.runner import InProcessRunner, StepReport, build_environment
from rlfleet.errors import UserError

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 900.0  # scheduling the actor and loading its model (a large judge on a cold node)


class _EnvironmentActor:
    """Runs in the Ray actor: the environment and an in-process runner over it."""

    def __init__(self, name: str, path: str, cfg: Mapping[str, Any]) -> None:
        self.runner = InProcessRunner(name, build_environment(path, cfg))

    def ready(self) -> tuple[list[str] | None, list[dict[str, Any]] | None, int]:
        """The environment's first-turn stop strings and tools, and this actor's process id."""
        env = self.runner.environment
        stops = None if env.stop_strings is None else list(env.stop_strings)
        tools = None if env.tools is None else [dict(tool) for tool in env.tools]
        return stops, tools, os.getpid()

    def step(self, logs: list[MessageLog], metadata: list[Any]) -> StepReport:
        return self.runner.step(logs, metadata)

    def environment_step(self, logs: list[MessageLog], metadata: list[Any]) -> EnvironmentReturn[Any]:
        return self.runner.environment.step(logs, metadata)

    def metrics(self, batch: Mapping[str, Any]) -> dict[str, float]:
        return dict(self.runner.environment.global_post_process_and_metrics(batch)[1])

    def close(self) -> None:
        self.runner.close()


class RemoteEnvironment(EnvironmentInterface[Any]):
    """The trainer's view of an environment built in a Ray actor: the stop strings and tools the actor
    reported, and ``step`` and the step's metrics computed there."""

    def __init__(self, runner: RayActorRunner, stop_strings: list[str] | None, tools: Any) -> None:
        super().__init__({})
        self._runner = runner
        self.stop_strings = stop_strings
        self.tools = tools

    def step(self, message_log_batch: list[MessageLog], metadata: list[Any]) -> EnvironmentReturn[Any]:
        return self._runner.call("environment_step", message_log_batch, metadata)  # type: ignore[no-any-return]

    def global_post_process_and_metrics(
        self, batch: Mapping[str, Any]
    ) -> tuple[Mapping[str, Any], dict[str, float]]:
        try:
            return batch, self._runner.call("metrics", dict(batch))
        except ray.exceptions.RayActorError as exc:  # the step's rewards stand; its env metrics are lost
            name = self._runner.name
            log.error("environment %s: its actor died computing the step's metrics (%s)", name, exc)
            return batch, {}


class RayActorRunner:
    """Steps ``path``'s environment in one Ray actor holding ``num_gpus`` GPUs (Ray must be initialised).

    Raises:
        UserError: The cluster has fewer free GPUs than ``num_gpus``, or the actor does not start within
            ``startup_timeout_s`` (it does not fit, or its model loads too slowly).
        EnvironmentLoadError / the constructor's error: The environment cannot be built in the actor.
    """

    def __init__(
        self,
        name: str,
        path: str,
        cfg: Mapping[str, Any],
        *,
        num_gpus: int = 0,
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
    ) -> None:
        if not ray.is_initialized():
            raise RuntimeError("RayActorRunner needs Ray initialised first (connect_or_start or ray.init)")
        free = ray.available_resources().get("GPU", 0.0)
        if num_gpus > free:
            raise UserError(
                f"env.{name}.resources.gpus_per_node={num_gpus}, but the Ray cluster has {free:g} GPU(s) "
                "free once the policy has started (the environment's actor takes GPUs beside cluster.*); "
                f"fix: a cluster with a free GPU for it, or env.{name}.resources.gpus_per_node=0 (CPU)"
            )
        self.name, self.path, self.cfg = name, path, dict(cfg)
        self.num_gpus, self.startup_timeout_s = num_gpus, startup_timeout_s
        # no CPU reserved: it computes while the trainer waits for its scores, as the environments' pools do
        self._remote = ray.remote(_EnvironmentActor).options(
            num_cpus=0, num_gpus=num_gpus, max_restarts=0, max_task_retries=0
        )
        self.num_restarts = 0
        self._actor: Any = None
        stops, tools = self._start()
        self.environment: EnvironmentInterface[Any] = RemoteEnvironment(self, stops, tools)

    def _start(self) -> tuple[list[str] | None, Any]:
        self._actor = self._remote.remote(self.name, self.path, self.cfg)
        try:
            stops, tools, pid = ray.get(self._actor.ready.remote(), timeout=self.startup_timeout_s)
        except ray.exceptions.GetTimeoutError:
            ray.kill(self._actor, no_restart=True)
            raise UserError(
                f"the {self.name} environment's Ray actor did not start within "
                f"{self.startup_timeout_s:.0f} s; "
                f"the cluster may lack a free {'GPU' if self.num_gpus else 'slot'} for it, or its model may "
                f"load slowly; fix: free resources for it (env.{self.name}.resources)"
            ) from None
        except ray.exceptions.RayTaskError as exc:  # the constructor raised: its own error, unwrapped
            ray.kill(self._actor, no_restart=True)
            raise exc.as_instanceof_cause() from None
        log.info("environment %s steps in Ray actor pid %d (%d GPU)", self.name, pid, self.num_gpus)
        return stops, tools

    def call(self, method: str, *args: Any) -> Any:
        """``method`` of the actor, waited for (an environment's own calls have no time bound here)."""
        return ray.get(getattr(self._actor, method).remote(*args))

    def step(self, logs: Sequence[MessageLog], metadata: Sequence[Any]) -> StepReport:
        if not logs:
            return StepReport([])
        for attempt in (1, 2):
            try:
                report: StepReport = self.call("step", list(logs), list(metadata))
                return report
            except ray.exceptions.RayActorError as exc:
                log.error(
                    "environment %s: its Ray actor died during a step (%s); %s",
                    self.name,
                    str(exc)[:300],
                    "starting it again and re-sending the step" if attempt == 1 else "the step's items get 0",
                )
                ray.kill(self._actor, no_restart=True)
                self._start()
                self.num_restarts += 1
        return StepReport([None] * len(logs), num_errors=len(logs))

    def close(self) -> None:
        """Closes the environment in its actor, then kills the actor (idempotent)."""
        actor, self._actor = self._actor, None
        if actor is None or not ray.is_initialized():
            return
        try:
            ray.get(actor.close.remote(), timeout=60)
        except Exception as exc:  # a dead or stuck actor: killing it is what is left
            log.warning("environment %s: closing its actor failed (%s)", self.name, exc)
        ray.kill(actor, no_restart=True)
