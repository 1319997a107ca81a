"""The generation-backend interface: token ids in, sampled token ids and their logprobs out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. ``greedy`` ignores temperature, top-p and top-k.

    ``stop_strings``: a response also ends after the token that completes one of these strings (that token
    is kept, so the response holds exactly the tokens sampled: an environment's ``</tool_call>``).
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    greedy: bool = False
    stop_strings: tuple[str, ...] = ()


@dataclass(frozen=True)
class GenerationResult:
    """One sampled response.

    Attributes:
        token_ids: Response tokens, ending with EOS when the model stopped by itself.
        logprobs: The logprob of each response token under ``softmax(logits / temperature)`` over
            the full vocabulary, before top-k/top-p (0.0 when greedy).
        text: The response decoded without special tokens.
        finished: True when the model emitted EOS, or completed a stop string, before ``max_new_tokens``.
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    text: str
    finished: bool


class GenerationBackend(Protocol):
    """What the algorithms need from a generation engine (HF ``generate`` or a vLLM engine)."""

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seed: int
    ) -> list[GenerationResult]:
        """Samples one response per prompt; the same ``seed`` and inputs give the same outputs."""
        ...

    def generate_rows(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int]
    ) -> list[GenerationResult]:
        """One response per prompt, row ``i`` sampled from ``seeds[i]`` alone (``generate`` draws them from
        ``row_seeds(seed, len(prompts))``), in the prompts' order."""
        ...

    def refit(self) -> None:
        """Makes the backend use the trainer's current weights (a no-op when it shares them)."""
        ...

    def take_metrics(self) -> dict[str, float]:
        """Metrics of the engines since the last call (per-worker throughput on Ray; may be empty)."""
        ...


class NoGeneration:
    """The backend of a run that samples nothing (a reward model's): no engine is built, and a call to
    generate is a bug, refused."""

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seed: int
    ) -> list[GenerationResult]:
        raise RuntimeError("this run builds no generation engine (a reward model generates nothing)")

    def generate_rows(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int]
    ) -> list[GenerationResult]:
        raise RuntimeError("this run builds no generation engine (a reward model generates nothing)")

    def refit(self) -> None:
        """Nothing to refit."""

    def take_metrics(self) -> dict[str, float]:
        return {}
