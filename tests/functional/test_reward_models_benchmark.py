"""Smoke test of benchmarks/reward_models.py: the three parts run from a given model and their tables print;
the verifier's view of validation samples and the validations of a run's records; its arguments."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from benchmarks.reward_models import SMOLLM2, main, parse_args, validations, verifier_metrics


def test_arguments_default_to_the_smollm2_judge_and_the_quick_run_judges_with_its_model() -> None:
    args = parse_args([])
    assert (args.model, args.judge_model, args.judge_samples, args.skip_judge) == (
        Path("runs/demo/sft_model"),
        SMOLLM2[0],
        32,
        False,
    )
    quick = parse_args(["--quick", "--skip-judge", "--rm", "rm.seed=3", "--grpo", "grpo.seed=4"])
    assert (quick.judge_model, quick.skip_judge, quick.rm, quick.grpo) == (
        None,
        True,
        ["rm.seed=3"],
        ["grpo.seed=4"],
    )
    with pytest.raises(SystemExit):
        parse_args(["--steps", "many"])


def test_the_verifier_scores_replies_whatever_the_reward_said() -> None:
    samples = [
        {"response": "2 + 3 = 5\n#### 5", "gold": "5", "reward": 0.9},  # correct, judged correct
        {"response": "#### 6", "gold": "5", "reward": 0.7},  # wrong, judged correct
        {"response": "#### 7", "gold": "7", "reward": 0.1},  # correct, judged wrong
        {"response": "no answer", "gold": "1", "reward": 0.0},  # wrong, judged wrong
    ]
    got = verifier_metrics(samples)
    assert got["val/verifier_accuracy"] == 0.5 and got["val/agreement"] == 0.5
    assert got["val/reward_of_correct"] == pytest.approx(0.5) and got["val/reward_of_wrong"] == pytest.approx(
        0.35
    )
    assert math.isnan(verifier_metrics(samples[:1])["val/reward_of_wrong"])


def test_validations_average_the_training_score_since_the_previous_one() -> None:
    records = [
        {"step": 0, "val/verifier_accuracy": 0.25},
        {"step": 1, "train/score": 1.0},
        {"step": 2, "train/score": 3.0, "val/verifier_accuracy": 0.5},
        {"step": 3, "train/score": 5.0, "val/verifier_accuracy": 0.75},
    ]
    got = validations(records, "score")
    assert [(v.step, v.accuracy) for v in got] == [(0, 0.25), (2, 0.5), (3, 0.75)]
    assert math.isnan(got[0].train_score) and [v.train_score for v in got[1:]] == [2.0, 5.0]


@pytest.mark.slow
def test_quick_run_prints_one_table_per_part(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["reward_models.py", "--quick", "--model", str(tiny_model_dir), "--out", str(tmp_path)]
    monkeypatch.setattr("sys.argv", argv)
    main()
    printed = capsys.readouterr().out
    first_cells = [line.split("|")[1].strip() for line in printed.splitlines() if line.startswith("| ")]
    # the reward model's row; part 2's validations at steps 0 and 2; the judge's at steps 0 and 1
    assert first_cells == ["pairs train/val", "32/8", "step", "0", "2", "step", "0", "1"]
    assert (
        "1. Bradley-Terry reward model" in printed
        and "2. GRPO rewarded" in printed
        and "3. LLM judge" in printed
    )
    assert (tmp_path / "rm_model" / "config.json").is_file()
