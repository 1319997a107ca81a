"""Generation backends behind one interface.

Also here: the per-rank ``worker.GenerationRank`` (an engine a Ray actor or a training rank hosts) and
``weights``, the one path of the trainer's weights to the engines.
"""

from rlfleet.generation.hf import HFGenerationBackend
from rlfleet.generation.interface import GenerationBackend, GenerationResult, NoGeneration, SamplingParams
from rlfleet.generation.vllm import VLLMGenerationBackend, VLLMSettings  # imports vllm only when started

__all__ = [
    "GenerationBackend",
    "GenerationResult",
    "HFGenerationBackend",
    "NoGeneration",
    "SamplingParams",
    "VLLMGenerationBackend",
    "VLLMSettings",
]
