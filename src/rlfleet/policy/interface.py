"""The policy interface: what the algorithms need from the trainable model, wherever it runs.

Two classes implement it structurally: :class:`~rlfleet.policy.rank.PolicyRank` (one model in this
process) and :class:`~rlfleet.distributed.ray_policy.RayPolicy` (the sharded training ranks on Ray, seen
as one). The loops (SFT, GRPO, ``rlfleet eval``) are typed against :class:`Policy` and the generation
side's :class:`~rlfleet.generation.GenerationBackend`, so they never learn which one they drive.
:data:`LossFn` is what they hand :meth:`Policy.train`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from rlfleet.policy.batch import TrainBatch
from rlfleet.policy.loss_math import Normalizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from rlfleet.policy.microbatch import MicroBatching

LossFn = Callable[[torch.Tensor, TrainBatch, Normalizer], tuple[torch.Tensor, dict[str, float]]]
"""A loss over one micro-batch: ``(token logprobs [n, T], micro-batch, global normaliser) -> (loss,
metrics)``; the metrics are summed over micro-batches (``rlfleet.policy.loss_functions``)."""


@runtime_checkable
class Policy(Protocol):
    """A trainable policy: logprobs and optimizer steps over batches, checkpoints, and its tokenizer."""

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The policy's tokenizer (its ``pad_token_id`` pads training batches)."""
        ...

    @property
    def has_reference(self) -> bool:
        """Whether a frozen copy of the initial weights is kept (``logprobs(..., reference=True)``)."""
        ...

    def accelerator_name(self) -> str:
        """The training device: a CUDA device name (e.g. ``NVIDIA H200``), or ``cpu``."""
        ...

    def logprobs(
        self,
        batch: TrainBatch,
        micro_batching: MicroBatching | int,
        *,
        reference: bool = False,
        temperature: float = 1.0,
    ) -> torch.Tensor:
        """``[B, T]`` token logprobs of the policy (or of the frozen reference) over ``batch``; a reward
        model's per-token scores (``rlfleet.policy.logprobs.token_scores``).

        ``micro_batching``: how the rows go through the model, a ``MicroBatching`` (fixed rows, dynamic
        batching or packing) or a row count (fixed micro-batches of that many rows)."""
        ...

    def train(
        self,
        batch: TrainBatch,
        loss_fn: LossFn,
        *,
        global_batch_size: int,
        micro_batching: MicroBatching | int,
        temperature: float = 1.0,
    ) -> dict[str, float]:
        """One optimizer step per ``global_batch_size`` rows of ``batch``; metrics averaged over steps."""
        ...

    def take_metrics(self, total_tokens: int) -> dict[str, float]:
        """Per-worker balance since the last call, which processed ``total_tokens`` (may be empty)."""
        ...

    def save(self, step_dir: Path) -> None:
        """Writes weights, optimizer, scheduler and tokenizer under ``step_dir/policy``."""
        ...

    def load(self, step_dir: Path) -> None:
        """Restores weights, optimizer and scheduler written by :meth:`save` (resume)."""
        ...

    def load_weights(self, step_dir: Path) -> None:
        """Restores the weights only (evaluating a checkpoint)."""
        ...

    def close(self) -> None:
        """Releases what the policy holds (the Ray actors); a no-op in-process."""
        ...
