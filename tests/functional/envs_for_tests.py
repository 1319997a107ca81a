"""Environments for the tests, importable by worker processes (``tests.functional.envs_for_tests:...``)."""

from __future__ import annotations

import os
import time
from typing import Any

from rlfleet.environments import EnvironmentInterface, EnvironmentReturn


def digit_fraction(text: str) -> float:
    return sum(c.isdigit() for c in text) / max(len(text), 1)


class ScriptedEnv(EnvironmentInterface[dict[str, Any]]):
    """Answers every turn with a ``tool`` message until ``cfg["turns"]`` turns; each turn pays the fraction of
    digits in the model's message (``cfg["paid"]: "constant"`` pays 0.25 instead).

    cfg: ``turns`` (default 3), ``stops`` (the next turns' stop strings, default none).
    """

    def step(self, message_log_batch: Any, metadata: Any) -> EnvironmentReturn[dict[str, Any]]:
        turns = int(self.cfg.get("turns", 3))
        metas = [{**m, "turn": m.get("turn", 0) + 1} for m in metadata]
        return EnvironmentReturn(
            observations=[{"role": "tool", "content": f"result {m['turn']}"} for m in metas],
            metadata=metas,
            next_stop_strings=[self.cfg.get("stops")] * len(metas),
            rewards=[
                0.25 if self.cfg.get("paid") == "constant" else digit_fraction(log[-1]["content"])
                for log in message_log_batch
            ],
            terminateds=[m["turn"] >= turns for m in metas],
            answers=None,
        )


class FlakyEnv(EnvironmentInterface[dict[str, Any]]):
    """Fails on the rows whose gold says how: ``raise``, ``hang``, ``malformed``, ``die``; else pays 1."""

    def step(self, message_log_batch: Any, metadata: Any) -> EnvironmentReturn[dict[str, Any]]:
        kinds = [m["ground_truth"] for m in metadata]
        if "raise" in kinds:
            raise RuntimeError("this environment failed on purpose")
        if "hang" in kinds:
            time.sleep(120)
        if "die" in kinds:
            os._exit(3)
        rewards = [1.0] * len(kinds) + ([1.0] if "malformed" in kinds else [])
        return EnvironmentReturn(
            observations=[{"role": "environment", "content": "ok"}] * len(kinds),
            metadata=list(metadata),
            next_stop_strings=[None] * len(kinds),
            rewards=rewards,
            terminateds=[True] * len(kinds),
            answers=None,
        )


class NotAnEnvironment:
    """Has no ``step``: naming it in a recipe is an error."""
