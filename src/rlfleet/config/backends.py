"""What each generation backend can do: the one place that knows, so no other module compares its name.

``policy.generation.backend`` names one of :data:`BACKENDS` (``auto`` is resolved by
:func:`rlfleet.config.resolved.generation_backend`); the plan, the checks, the memory estimate and the
builders read the capability they branch on from :func:`backend_of`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from rlfleet.config.resolved import VLLM_INSTALL_HINT, BackendName, generation_backend
from rlfleet.config.schema import MasterConfig


class HasBackend(Protocol):
    """Anything that names its resolved backend: a :class:`~rlfleet.config.layout.ResourceLayout`."""

    @property
    def backend(self) -> BackendName: ...


@dataclass(frozen=True)
class GenerationBackendInfo:
    """One generation backend's capabilities.

    Attributes:
        name: The value of ``policy.generation.backend`` that selects it.
        display_name: How ``plan`` and ``validate`` call it.
        package: The Python package it needs beyond the base install (None: none).
        install_hint: How to install ``package``.
        holds_own_weights: It generates from a copy of the weights of its own (an inference engine), refit
            after every optimizer step; else it generates with the policy's model itself.
        tensor_parallel: One engine may span several GPUs
            (``policy.generation.vllm_cfg.tensor_parallel_size``); else each generation worker is one device.
        own_memory: It takes memory of its own beside its weights: a KV cache (the rest of
            ``gpu_memory_utilization`` on a GPU, ``VLLM_CPU_KVCACHE_SPACE`` on a CPU) and an engine process.
        cpu_kv_cache_gib: Its KV cache space on a CPU where ``VLLM_CPU_KVCACHE_SPACE`` is unset (0: none).
        reads_vllm_cfg: ``policy.generation.vllm_cfg`` configures it (precision, ``max_model_len``, the
            engine's kwargs); else that section is not read.
        filtered_logprobs: The logprobs it reports are of the top-k/top-p filtered distribution, not the full
            softmax the trainer computes.
    """

    name: BackendName
    display_name: str
    package: str | None
    install_hint: str
    holds_own_weights: bool
    tensor_parallel: bool
    own_memory: bool
    cpu_kv_cache_gib: int
    reads_vllm_cfg: bool
    filtered_logprobs: bool


BACKENDS: dict[BackendName, GenerationBackendInfo] = {
    "hf": GenerationBackendInfo(
        name="hf",
        display_name="transformers' generate",
        package=None,
        install_hint="",
        holds_own_weights=False,
        tensor_parallel=False,
        own_memory=False,
        cpu_kv_cache_gib=0,
        reads_vllm_cfg=False,
        filtered_logprobs=False,
    ),
    "vllm": GenerationBackendInfo(
        name="vllm",
        display_name="vLLM",
        package="vllm",
        install_hint=VLLM_INSTALL_HINT,
        holds_own_weights=True,
        tensor_parallel=True,
        own_memory=True,
        cpu_kv_cache_gib=1,
        reads_vllm_cfg=True,
        filtered_logprobs=True,
    ),
}


def backend_of(source: MasterConfig | HasBackend) -> GenerationBackendInfo:
    """The generation backend of a config (``auto`` resolved) or of its resource layout."""
    name = generation_backend(source).name if isinstance(source, MasterConfig) else source.backend
    return BACKENDS[name]
