"""The names logged metrics go by: one spelling rule shared by config validation and checkpoint ranking.

Recipes may write NeMo RL's ``val:accuracy``; loggers and ``training_info.json`` write ``val/accuracy``.
:func:`normalize_metric_name` maps one to the other, and both :func:`rlfleet.config.check_config` (is the
name one the algorithm logs?) and :class:`rlfleet.checkpoint.CheckpointManager` (which key ranks the
checkpoints?) call it, so a name that passes validation is exactly the key ranking reads.
"""

from __future__ import annotations

LOGGED_METRICS: dict[str, frozenset[str]] = {
    "grpo": frozenset(
        {
            "val/accuracy",
            "val/reward",
            "val/mean_response_length",
            "train/reward",
            "train/loss",
            "train/kl",
        }
    ),
    "sft": frozenset({"val/accuracy", "val/reward", "val/mean_response_length", "train/loss"}),
    # DPO validates a task's greedy accuracy (pairs from its own samples) or, on a preference dataset,
    # the loss and pair accuracy over the validation pairs
    "dpo": frozenset({"val/accuracy", "val/reward", "val/mean_response_length", "val/loss", "train/loss"}),
    # a reward model validates its loss and pair accuracy (the chosen reply scoring higher) on held-out pairs
    "rm": frozenset({"val/accuracy", "val/loss", "train/loss", "train/accuracy"}),
    # distillation validates the task's greedy accuracy, as GRPO
    "distillation": frozenset({"val/accuracy", "val/reward", "val/mean_response_length", "train/loss"}),
}
"""Metrics each algorithm logs: the valid ``checkpointing.metric_name`` values (after normalisation)."""


def normalize_metric_name(name: str) -> str:
    """The logged key a metric name means: surrounding whitespace dropped, ``:`` read as ``/``.

    ``" val:accuracy"`` -> ``"val/accuracy"`` (NeMo RL writes ``:``, loggers write ``/``).
    """
    return name.strip().replace(":", "/")
