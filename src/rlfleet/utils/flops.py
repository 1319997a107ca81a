"""Model FLOPs of a decoder pass and model FLOPs utilisation (MFU), as pure functions.

Conventions (those of the PaLM paper's MFU, which NeMo RL and Megatron also report): a multiply-add is 2
FLOPs; a forward pass costs ``2 x (matmul weights)`` per token plus causal attention, ``2 x 2 x d_attn x
context`` per token and layer (``QK^T`` and ``AV``; a token at position ``i`` attends to ``i + 1`` keys);
a training pass (forward + backward) costs 3 forward passes. Embedding lookups, norms and softmaxes are not
counted. MFU divides the model FLOPs by the time and the device's dense peak: recomputation (activation
checkpointing) therefore lowers MFU, as it should.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# Dense (no sparsity) peak TFLOP/s of one device for 16-bit matmuls, from the vendors' data sheets.
# float32 runs on TF32 tensor cores at half of it where the device has them.
PEAK_TFLOPS_16BIT: dict[str, float] = {
    "H200": 989.0,
    "H100": 989.0,
    "H800": 989.0,
    "GH200": 989.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "L4": 121.0,
    "A10G": 125.0,
    "A10": 125.0,
    "V100": 125.0,
    "T4": 65.0,
}


@dataclass(frozen=True)
class ModelShape:
    """What the FLOP count needs to know of a model."""

    matmul_parameters: int  # weights of every nn.Linear (the LM head included, embeddings excluded)
    num_layers: int
    attention_dim: int  # num_attention_heads x head_dim


def model_shape(model: nn.Module, num_layers: int, attention_dim: int) -> ModelShape:
    """The ``ModelShape`` of a loaded model (its ``nn.Linear`` weights counted once each)."""
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        if isinstance(module, nn.Linear) and id(module.weight) not in seen:
            seen.add(id(module.weight))
            total += module.weight.numel()
    return ModelShape(total, num_layers, attention_dim)


def shape_from_config(model: PreTrainedModel) -> ModelShape:
    """``model_shape`` with the layer count and attention width read from ``model.config`` (HF models)."""
    config = model.config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return model_shape(model, config.num_hidden_layers, heads * head_dim)


def forward_flops(shape: ModelShape, sequence_lengths: Sequence[int]) -> float:
    """Model FLOPs of one forward pass over sequences of these lengths (no padding counted)."""
    total = 0.0
    for length in sequence_lengths:
        total += 2.0 * shape.matmul_parameters * length
        # sum over positions i of (i + 1) keys = L (L + 1) / 2, times QK^T and AV, 2 FLOPs each
        total += 4.0 * shape.num_layers * shape.attention_dim * length * (length + 1) / 2
    return total


def training_flops(shape: ModelShape, sequence_lengths: Sequence[int]) -> float:
    """Forward + backward: 3 forward passes."""
    return 3.0 * forward_flops(shape, sequence_lengths)


def peak_flops(device_name: str, dtype_bits: int = 16) -> float | None:
    """Dense peak FLOP/s of the named device (e.g. ``NVIDIA H200``), or None when it is not in the table.

    ``dtype_bits=32`` gives the TF32 rate (half the 16-bit one).
    """
    name = device_name.upper()
    for key in sorted(PEAK_TFLOPS_16BIT, key=len, reverse=True):  # "GH200" before "H200"
        if key in name:
            tflops = PEAK_TFLOPS_16BIT[key]
            return tflops * 1e12 * (0.5 if dtype_bits == 32 else 1.0)
    return None


def mfu(flops: float, seconds: float, peak: float, devices: int = 1) -> float:
    """Model FLOPs utilisation: achieved FLOP/s over the peak of ``devices`` devices."""
    if seconds <= 0 or peak <= 0 or devices < 1:
        raise ValueError(f"mfu needs positive seconds, peak and devices; got {seconds}, {peak}, {devices}")
    return flops / seconds / (peak * devices)


@dataclass(frozen=True)
class FlopMeter:
    """MFU of the logprob and training passes of a step, on ``devices`` devices of peak ``peak``."""

    shape: ModelShape
    peak: float
    devices: int

    def step_mfu(self, sequence_lengths: Sequence[int], extra_forward_passes: int, seconds: float) -> float:
        """A training pass and ``extra_forward_passes`` logprob passes over the sequences in ``seconds``."""
        flops = training_flops(self.shape, sequence_lengths)
        flops += extra_forward_passes * forward_flops(self.shape, sequence_lengths)
        return mfu(flops, seconds, self.peak, self.devices)
