"""Generation backends behind one interface."""

from rlfleet.generation.hf import HFGenerationBackend
from rlfleet.generation.interface import GenerationBackend, GenerationResult, SamplingParams

__all__ = ["GenerationBackend", "GenerationResult", "HFGenerationBackend", "SamplingParams"]
