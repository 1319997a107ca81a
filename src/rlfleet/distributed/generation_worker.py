"""The per-rank generation engine: a full copy of the policy and the HF backend that samples from it.

A plain class. Colocated, it lives inside each training rank and is refitted in place from the gathered
training weights; dedicated, the Ray layer hosts it on its own bundles and it receives the weights by
broadcast (``RefitGroup``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from rlfleet.distributed.refit import RefitGroup, WeightSpec, weight_spec
from rlfleet.generation import GenerationResult, HFGenerationBackend, SamplingParams
from rlfleet.models.loading import ModelSource


@dataclass(frozen=True)
class WorkerOutput:
    """Generated responses and what producing them cost this worker."""

    results: list[GenerationResult]
    seconds: float
    tokens: int


class GenerationWorker:
    """Generates with an unsharded copy of the policy.

    Args:
        source: The policy to load (its initial weights; refits replace them).
        batch_size: Prompts per ``generate`` call.
    """

    def __init__(self, source: ModelSource, batch_size: int) -> None:
        self.device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        self.model = source.load_model().to(self.device)
        self.model.eval()
        self.model.requires_grad_(False)
        self.backend = HFGenerationBackend(self.model, source.load_tokenizer(), batch_size)
        self.refit_group: RefitGroup | None = None

    def generate_rows(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int]
    ) -> WorkerOutput:
        """Samples one response per prompt (row ``i`` from ``seeds[i]``), timed."""
        start = time.perf_counter()
        results = self.backend.generate_rows(prompts, params, seeds) if prompts else []
        tokens = sum(len(r.token_ids) for r in results)
        return WorkerOutput(results, time.perf_counter() - start, tokens)

    def weight_spec(self) -> WeightSpec:
        """Names and shapes of the weights this engine expects from a refit."""
        return weight_spec(self.model.state_dict())

    @torch.no_grad()
    def load_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        """Colocated refit: copies full tensors into the engine's parameters in place."""
        own = self.model.state_dict()
        missing = sorted(set(own) - set(state))
        if missing:
            raise KeyError(f"refit is missing {len(missing)} weight(s), e.g. {missing[:3]}")
        for name, tensor in own.items():
            tensor.copy_(state[name])

    def join_refit_group(
        self, master_addr: str, master_port: int, rank: int, size: int, timeout_s: float
    ) -> None:
        """Dedicated refit: joins the broadcast group (rank 0 is the trainer)."""
        dtype = next(self.model.parameters()).dtype
        self.refit_group = RefitGroup(master_addr, master_port, rank, size, timeout_s, dtype)

    @torch.no_grad()
    def receive_weights(self, spec: WeightSpec) -> None:
        """Dedicated refit: receives the trainer's broadcast into the engine's parameters."""
        if self.refit_group is None:
            raise RuntimeError("join_refit_group must run before receive_weights")
        self.refit_group.receive(self.model.state_dict(), spec)
