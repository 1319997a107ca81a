"""``benchmarks/rollout_paths.py``: its arguments, and one quick run in which the removed single-turn path and
the one path (a one-turn math episode) sample and score the same rollouts, token for token."""

from __future__ import annotations

import pytest
from benchmarks import rollout_paths


def test_quick_shrinks_the_case_and_keeps_user_overrides() -> None:
    args = rollout_paths.parse_args(["--quick", "grpo.seed=3"])
    assert args.steps == 2
    assert "grpo.num_prompts_per_step=2" in args.overrides and args.overrides[-1] == "grpo.seed=3"
    assert rollout_paths.parse_args([]).recipe == rollout_paths.DEFAULT_RECIPE


def test_both_paths_collect_the_same_rollouts_and_both_train(capsys: pytest.CaptureFixture[str]) -> None:
    rollout_paths.main(["--quick", "--model", "/nonexistent"])  # the tiny base model is built
    out = capsys.readouterr().out
    assert "collect, same prompts and seeds" in out and "whole GRPO steps" in out
    for path in ("single-turn (generate + reward pool)", "one path (one-turn math episode)"):
        assert out.count(path) == 2
