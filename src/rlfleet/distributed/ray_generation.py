"""The driver's handle on the generation engines of a Ray run: sampling and refit.

The engines are those ``RayRuntime`` starts (``rlfleet.distributed.ray_policy``): colocated, one inside
the first training rank of each group of ``vllm_cfg.tensor_parallel_size`` ranks; dedicated, one
``rlfleet.generation.rank.GenerationRank`` actor per bundle of its own. How the weights reach them is
``rlfleet.generation.weights``; this module only orchestrates it (and replaces dead dedicated engines).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TypeVar

from rlfleet.distributed.rank_group import RankDiedError, RankTimeoutError, RayRankGroup, gather
from rlfleet.distributed.ray_policy import RayRuntime, TrainingWorkerLostError, balance_metrics
from rlfleet.errors import UserError
from rlfleet.generation import GenerationResult, SamplingParams
from rlfleet.generation.rank import RankOutput
from rlfleet.generation.sampling import row_seeds
from rlfleet.generation.weights import WeightSpec

log = logging.getLogger(__name__)

T = TypeVar("T")


def split_rows(count: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, stop)`` ranges of ``count`` rows over ``parts`` workers, sizes within one."""
    base, extra = divmod(count, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


class GenerationWorkerLostError(UserError, RuntimeError):
    """The dedicated generation workers kept failing (dying, or not answering within
    ``cluster.call_timeout_s``) after the ``cluster.generation_retries`` restarts allowed; the message
    names both settings (exit 2 from the CLI, like every error the user can act on)."""

    @classmethod
    def out_of_retries(cls, exc: Exception, retries: int) -> GenerationWorkerLostError:
        return cls(
            f"generation failed after {retries} restart(s) of the dedicated generation workers "
            f"(cluster.generation_retries={retries}); the last failure: {exc}. Check the generation workers' "
            "logs (an out-of-memory kill?), then raise cluster.generation_retries to allow more restarts, or "
            "cluster.call_timeout_s if they were only slow; rerun the same command to resume from the last "
            "checkpoint (checkpointing.checkpoint_dir)"
        )


class RayGeneration:
    """Generation on the engines of a ``RayRuntime`` (implements ``rlfleet.generation.GenerationBackend``).

    Rows are split into contiguous shares, one per engine, and sampled from per-row seeds, so the
    responses do not depend on the number of engines. A dead dedicated engine is replaced, refitted and the
    generation retried (``retries`` times, a failed restart counting as a failed retry; then
    ``GenerationWorkerLostError``); a dead colocated engine is a dead training rank: that raises.
    """

    def __init__(self, runtime: RayRuntime, retries: int) -> None:
        self.runtime = runtime
        self.retries = retries
        self.spec: WeightSpec | None = None  # the refit's: the trainer's tensors in the engines' dtype
        self.last_metrics: dict[str, float] = {}
        self.restarts = 0
        if runtime.layout.colocated:
            self.refit()  # a colocated vLLM engine starts with dummy weights
        else:
            self._start_dedicated()

    def _engines(self) -> RayRankGroup:
        if self.runtime.layout.colocated:
            return self.runtime.training()
        if self.runtime.gen is None:
            raise RuntimeError("the generation workers are shut down")
        return self.runtime.gen

    def _start_dedicated(self) -> None:
        """Starts the engines and the refit group, then sends them the trainer's current weights."""
        gen = self.runtime.start_generation_group()
        train = self.runtime.training()
        sent = train.run_all("weight_spec")[0]
        expected = gen.run_all("weight_spec")
        for rank, theirs in enumerate(expected):
            if theirs.tensors != sent.tensors:
                raise ValueError(
                    f"generation rank {rank} expects other weights than the trainer sends "
                    f"({len(theirs.tensors)} vs {len(sent.tensors)} tensors); both must load "
                    "policy.model_name"
                )
        dtypes = {spec.dtype for spec in expected}
        if len(dtypes) != 1:
            names = sorted(str(dtype).removeprefix("torch.") for dtype in dtypes)
            raise RuntimeError(f"the generation engines run in different precisions: {names}")
        self.spec = replace(sent, dtype=dtypes.pop())  # travels in the engines' dtype
        addr, port = train.free_port_on_rank0()
        size = 1 + gen.world_size
        timeout = self.runtime.call_timeout_s
        refs = train.submit("join_refit_group", addr, port, 0, size, timeout)  # training rank 0 joins as 0
        refs += [
            gen.submit_to(i, "join_refit_group", addr, port, i + 1, size, timeout) for i in range(size - 1)
        ]
        gather(refs, timeout)
        self._broadcast()

    def _broadcast(self) -> None:
        gen, train = self._engines(), self.runtime.training()
        refs = train.submit("broadcast_weights", self.spec) + gen.submit("broadcast_weights", self.spec)
        gather(refs, self.runtime.call_timeout_s)

    def refit(self) -> None:
        """Makes every engine use the trainer's current weights (colocated: each training rank loads its
        own engine; dedicated: training rank 0 broadcasts to the generation workers)."""
        if self.runtime.layout.colocated:
            self.runtime.training().run_all("refit")
        else:
            self._retrying(self._broadcast)

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seed: int
    ) -> list[GenerationResult]:
        return self.generate_rows(prompts, params, row_seeds(seed, len(prompts)))

    def generate_rows(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int]
    ) -> list[GenerationResult]:
        """One response per prompt, row ``i`` sampled from ``seeds[i]`` alone, split over the engines."""
        if len(seeds) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        return self._retrying(lambda: self._generate(prompts, params, list(seeds)))

    def _engine_ranks(self) -> list[int]:
        """The ranks that host an engine: every dedicated worker; colocated, the first rank of each group
        of ``gen_tp`` training ranks (a tensor-parallel vLLM engine spans its group's GPUs)."""
        lay = self.runtime.layout
        return list(range(0, self._engines().world_size, lay.gen_tp if lay.colocated else 1))

    def _generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seeds: list[int]
    ) -> list[GenerationResult]:
        ranks = self._engine_ranks()
        shares = split_rows(len(prompts), len(ranks))
        outputs: list[RankOutput] = self._engines().run_on(
            ranks, "generate_rows", [([list(p) for p in prompts[a:b]], params, seeds[a:b]) for a, b in shares]
        )
        self.last_metrics = balance_metrics(
            "generation", [o.seconds for o in outputs], [o.tokens for o in outputs]
        )
        return [result for output in outputs for result in output.results]

    def _retrying(self, action: Callable[[], T]) -> T:
        attempt = 0
        while True:
            try:
                if attempt:  # replace the failed engines; a restart that fails is a failed retry too
                    start = time.perf_counter()
                    self._start_dedicated()
                    log.warning("generation engines restarted in %.1fs", time.perf_counter() - start)
                return action()
            except (RankDiedError, RankTimeoutError) as exc:
                if self.runtime.layout.colocated and isinstance(exc, RankDiedError):
                    raise TrainingWorkerLostError.from_death(exc) from exc  # the engines are trainers
                if self.runtime.layout.colocated:
                    raise
                if attempt >= self.retries:
                    raise GenerationWorkerLostError.out_of_retries(exc, self.retries) from exc
                attempt += 1
                self.restarts += 1
                log.warning("generation worker failed (%s); restarting the engines, retry %d", exc, attempt)

    def take_metrics(self) -> dict[str, float]:
        """Per-engine throughput and imbalance of the last ``generate``, and restarts so far."""
        metrics, self.last_metrics = self.last_metrics, {}
        return {**metrics, "perf/generation_restarts": float(self.restarts)}
