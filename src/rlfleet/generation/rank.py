"""The per-rank generation engine: an HF copy of the policy, or a vLLM engine, and the backend that samples.

A plain class. Colocated, it lives inside each training rank (``ShardedPolicyRank``) and takes the
gathered training weights (``update_weights``); dedicated, the Ray layer hosts it on its own bundles and it
receives them by broadcast (``join_refit_group``, ``broadcast_weights``). Both end in the backend's
``load_buckets``: the HF engine copies into its parameters in place; the vLLM engine holds no copy in this
process, each bucket becomes a safetensors file its workers reload. See :mod:`rlfleet.generation.weights`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM

from rlfleet.generation.hf import HFGenerationBackend
from rlfleet.generation.interface import GenerationResult, SamplingParams
from rlfleet.generation.vllm import VLLMGenerationBackend, VLLMSettings
from rlfleet.generation.weights import RefitGroup, WeightSpec, buckets, check_complete, weight_spec
from rlfleet.models.loading import DTYPES, ModelSource


@dataclass(frozen=True)
class RankOutput:
    """Generated responses and what producing them cost this worker."""

    results: list[GenerationResult]
    seconds: float
    tokens: int


class GenerationRank:
    """Generates with an unsharded copy of the policy (HF ``generate``) or a vLLM engine.

    Args:
        source: The policy to load (HF: its initial weights, refits replace them; vLLM: its config and
            tokenizer, the weights arrive by refit before the first generation).
        batch_size: Prompts per ``generate`` call (HF).
        vllm: The vLLM engine's settings; None generates with HF.
    """

    def __init__(self, source: ModelSource, batch_size: int, vllm: VLLMSettings | None = None) -> None:
        self.device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        tokenizer = source.load_tokenizer()
        self.backend: HFGenerationBackend | VLLMGenerationBackend
        if vllm is None:
            model = source.load_model()
            # transformers' @wraps on PreTrainedModel.to hides the bound self from mypy
            model.to(self.device)  # type: ignore[arg-type]
            model.eval()
            model.requires_grad_(False)
            self.backend = HFGenerationBackend(model, tokenizer, batch_size)
            self.spec = weight_spec(model.state_dict(), next(model.parameters()).dtype)
            self.bucket_device = self.device  # copied in place on the engine's device
        else:
            config = source.load_config()
            with torch.device("meta"):  # names and shapes only
                state = AutoModelForCausalLM.from_config(config).state_dict()
            self.backend = VLLMGenerationBackend.receiving(config, tokenizer, vllm)
            self.spec = weight_spec(state, DTYPES[vllm.precision])
            self.bucket_device = torch.device("cpu")  # written to files
        self.tensor_parallel_size = 1 if vllm is None else vllm.tensor_parallel_size
        self.refit_group: RefitGroup | None = None

    def generate_rows(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int]
    ) -> RankOutput:
        """Samples one response per prompt (row ``i`` from ``seeds[i]``), timed."""
        start = time.perf_counter()
        results = self.backend.generate_rows(prompts, params, seeds) if prompts else []
        tokens = sum(len(r.token_ids) for r in results)
        return RankOutput(results, time.perf_counter() - start, tokens)

    def weight_spec(self) -> WeightSpec:
        """Names and shapes of the weights this engine expects, and its dtype (what they travel in)."""
        return self.spec

    def update_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        """Colocated refit: loads the full tensors ``state`` (every weight's) into the engine."""
        check_complete(self.spec, state)
        self.backend.load_buckets(buckets(state, self.spec.dtype, device=self.bucket_device))

    def join_refit_group(
        self, master_addr: str, master_port: int, rank: int, size: int, timeout_s: float
    ) -> None:
        """Dedicated refit: joins the broadcast group as ``rank`` (rank 0 is the trainer)."""
        if self.refit_group is not None:
            self.refit_group.close()
        self.refit_group = RefitGroup(master_addr, master_port, rank, size, timeout_s)

    def broadcast_weights(self, spec: WeightSpec) -> None:
        """Dedicated refit: receives the trainer's broadcast (``spec``: the refit's) into the engine."""
        if self.refit_group is None:
            raise RuntimeError("join_refit_group must run before broadcast_weights")
        self.backend.load_buckets(self.refit_group.receive(spec))

    def close(self) -> None:
        """Stops a vLLM engine's process (the HF engine holds nothing outside this process)."""
        if isinstance(self.backend, VLLMGenerationBackend):
            self.backend.close()
