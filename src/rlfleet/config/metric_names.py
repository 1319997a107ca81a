"""The names logged metrics go by: one spelling rule shared by config validation and checkpoint ranking.

Recipes may write NeMo RL's ``val:accuracy``; loggers and ``training_info.json`` write ``val/accuracy``.
:func:`normalize_metric_name` maps one to the other, and both :func:`rlfleet.config.check_config` (is the name
one the algorithm logs, as its description lists them?) and :class:`rlfleet.checkpoint.CheckpointManager`
(which key ranks the checkpoints?) call it, so a name that passes validation is exactly the key ranking
reads."""

from __future__ import annotations


def normalize_metric_name(name: str) -> str:
    """The logged key a metric name means: surrounding whitespace dropped, ``:`` read as ``/``.

    ``" val:accuracy"`` -> ``"val/accuracy"`` (NeMo RL writes ``:``, loggers write ``/``).
    """
    return name.strip().replace(":", "/")
