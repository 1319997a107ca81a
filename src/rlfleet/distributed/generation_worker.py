"""The per-rank generation engine: an HF copy of the policy, or a vLLM engine, and the backend that samples.

A plain class. Colocated, it lives inside each training rank and is refitted from the gathered training
weights; dedicated, the Ray layer hosts it on its own bundles and it receives the weights by broadcast
(``RefitGroup``). The HF engine copies them into its parameters in place; the vLLM engine holds no copy in
this process: each bucket goes to ``VLLMGenerationBackend.load_weights`` (safetensors files reloaded by the
engine's workers), the path of the in-process vLLM refit.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from rlfleet.distributed.refit import RefitGroup, WeightSpec, weight_spec
from rlfleet.generation import GenerationResult, HFGenerationBackend, SamplingParams
from rlfleet.generation.vllm import DTYPES, VLLMGenerationBackend, VLLMSettings, weight_buckets
from rlfleet.models.loading import ModelSource


@dataclass(frozen=True)
class WorkerOutput:
    """Generated responses and what producing them cost this worker."""

    results: list[GenerationResult]
    seconds: float
    tokens: int


class GenerationWorker:
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
        self.model: PreTrainedModel | None = None
        self.backend: HFGenerationBackend | VLLMGenerationBackend
        if vllm is None:
            self.model = source.load_model()
            # transformers' @wraps on PreTrainedModel.to hides the bound self from mypy
            self.model.to(self.device)  # type: ignore[arg-type]
            self.model.eval()
            self.model.requires_grad_(False)
            self.backend = HFGenerationBackend(self.model, tokenizer, batch_size)
            self.dtype = next(self.model.parameters()).dtype
            self.spec = weight_spec(self.model.state_dict())
        else:
            config = source.load_config()
            with torch.device("meta"):  # names and shapes only
                self.spec = weight_spec(AutoModelForCausalLM.from_config(config).state_dict())
            self.backend = VLLMGenerationBackend.receiving(config, tokenizer, vllm)
            self.dtype = DTYPES[vllm.precision]
        self.tensor_parallel_size = 1 if vllm is None else vllm.tensor_parallel_size
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
        return self.spec

    def refit_precision(self) -> str:
        """The dtype name the weights travel in to this engine (its own)."""
        return str(self.dtype).removeprefix("torch.")

    @torch.no_grad()
    def load_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        """Colocated refit: loads the full tensors ``state`` (every weight's) into the engine."""
        missing = sorted({name for name, _ in self.weight_spec()} - set(state))
        if missing:
            raise KeyError(f"refit is missing {len(missing)} weight(s), e.g. {missing[:3]}")
        if isinstance(self.backend, VLLMGenerationBackend):
            self.backend.load_weights(weight_buckets(state, self.dtype, self.backend.settings.bucket_bytes))
            return
        assert self.model is not None  # the HF engine holds its model
        for name, tensor in self.model.state_dict().items():
            tensor.copy_(state[name])

    def join_refit_group(
        self, master_addr: str, master_port: int, rank: int, size: int, timeout_s: float
    ) -> None:
        """Dedicated refit: joins the broadcast group (rank 0 is the trainer)."""
        if self.refit_group is not None:
            self.refit_group.close()
        self.refit_group = RefitGroup(master_addr, master_port, rank, size, timeout_s, self.dtype)

    @torch.no_grad()
    def receive_weights(self, spec: WeightSpec) -> None:
        """Dedicated refit: receives the trainer's broadcast into the engine."""
        if self.refit_group is None:
            raise RuntimeError("join_refit_group must run before receive_weights")
        if isinstance(self.backend, VLLMGenerationBackend):
            self.backend.load_weights(self.refit_group.receive_buckets(spec))
        else:
            assert self.model is not None  # the HF engine holds its model
            self.refit_group.receive(self.model.state_dict(), spec)

    def close(self) -> None:
        """Stops a vLLM engine's process (the HF engine holds nothing outside this process)."""
        if isinstance(self.backend, VLLMGenerationBackend):
            self.backend.close()
