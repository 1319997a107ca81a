"""Generation backends behind one interface."""

from rlfleet.generation.hf import HFGenerationBackend
from rlfleet.generation.interface import GenerationBackend, GenerationResult, SamplingParams
from rlfleet.generation.vllm import VLLMGenerationBackend, VLLMSettings  # imports vllm only when started

__all__ = [
    "GenerationBackend",
    "GenerationResult",
    "HFGenerationBackend",
    "SamplingParams",
    "VLLMGenerationBackend",
    "VLLMSettings",
]
