"""Typed records passed between the data stage and the algorithms."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Example:
    """One task row in GSM8k form.

    Attributes:
        question: The problem statement shown to the model.
        answer: The worked solution ending in ``#### N`` (the SFT target).
        gold: The final answer alone (``"72"``), what rewards compare against.
        env: The environment that scores the row (a data row's ``task_name``); None: the recipe's default.
        extra: What else the environment reads of the row (a code task's tests), as its metadata.
    """

    question: str
    answer: str
    gold: str
    env: str | None = None
    extra: Mapping[str, Any] | None = field(default=None, compare=False, hash=False)


@dataclass(frozen=True)
class Prompt:
    """An ``Example`` rendered through the chat template.

    Attributes:
        example: The source row.
        text: The prompt string given to the model (chat template applied, generation prompt added).
        token_ids: ``text`` tokenised, without padding.
    """

    example: Example
    text: str
    token_ids: tuple[int, ...]
