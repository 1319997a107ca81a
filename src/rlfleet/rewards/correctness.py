"""What "correct" means for a scored response: the one rule behind every accuracy rlfleet reports.

``train/accuracy``, ``val/accuracy`` and the pass@k of ``rlfleet eval`` all count a response as correct when
:func:`is_correct` says so: its reward is strictly above one half. The shipped math reward is 1.0 (right) or
0.0 (wrong); a graded reward (partial credit, a format bonus) counts only when it gives more than half
credit, so a response that earns exactly 0.5 is not correct. Mean reward is reported separately
(``train/reward``, ``val/reward``).
"""

from __future__ import annotations

CORRECT_ABOVE = 0.5
"""A reward strictly above this counts as a correct response."""


def is_correct(reward: float) -> bool:
    """Whether a response with this reward counts as correct (``reward > 0.5``)."""
    return reward > CORRECT_ABOVE
