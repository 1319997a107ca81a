"""Unit tests for rlfleet.logging: metrics JSONL / TensorBoard, samples, truncation, plots, console."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from rlfleet.logging import MetricsLogger, Progress, format_step_line, plot_run, read_metrics
from rlfleet.logging.plot import moving_average

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _tb_events(directory: Path) -> list[Path]:
    return list(directory.rglob("events.out.tfevents*"))


def test_log_writes_flat_jsonl_with_int_step(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, tensorboard_enabled=False) as logger:
        logger.log(1, {"train/reward": 0.5, "val/accuracy": 1, "timing/generation": 2.25})
        logger.log(2, {"train/reward": torch.tensor(0.25), "train/loss": np.float32(-1.5)})
        # Flushed per line: readable before close.
        assert len(_lines(tmp_path / "metrics.jsonl")) == 2
    rows = _lines(tmp_path / "metrics.jsonl")
    assert rows[0] == {"step": 1, "train/reward": 0.5, "val/accuracy": 1, "timing/generation": 2.25}
    assert rows[1] == {"step": 2, "train/reward": 0.25, "train/loss": -1.5}
    assert all(type(row["step"]) is int for row in rows)
    assert all(isinstance(value, int | float) for row in rows for value in row.values())
    assert read_metrics(tmp_path) == rows


def test_nan_and_inf_written_as_null(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, tensorboard_enabled=False) as logger:
        logger.log(3, {"train/kl": math.nan, "train/loss": math.inf, "x": torch.tensor(float("-inf"))})
    text = (tmp_path / "metrics.jsonl").read_text(encoding="utf-8")
    assert "NaN" not in text and "Infinity" not in text
    assert json.loads(text) == {"step": 3, "train/kl": None, "train/loss": None, "x": None}


def test_truncate_after_keeps_only_earlier_steps_and_drops_torn_line(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, tensorboard_enabled=False) as logger:
        for step in range(1, 6):
            logger.log(step, {"train/reward": step / 10})
            logger.log_samples(step, [{"prompt": f"p{step}", "response": "r", "reward": 1.0}])
    for name in ("metrics.jsonl", "samples.jsonl"):
        with (tmp_path / name).open("a", encoding="utf-8") as handle:
            handle.write('{"step": 6, "train/rew')  # torn by a kill mid-write

    with MetricsLogger(tmp_path, tensorboard_enabled=False) as logger:
        logger.truncate_after(3)
        assert [row["step"] for row in _lines(tmp_path / "metrics.jsonl")] == [1, 2, 3]
        assert [row["step"] for row in _lines(tmp_path / "samples.jsonl")] == [1, 2, 3]
        logger.log(4, {"train/reward": 0.4})
        logger.log_samples(4, [{"prompt": "p4"}])
    assert [row["step"] for row in _lines(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]
    assert [row["step"] for row in _lines(tmp_path / "samples.jsonl")] == [1, 2, 3, 4]
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".*.tmp"))


def test_torn_line_is_skipped_by_reader_and_not_glued_to_next_append(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "a": 1.0}\n{"step": 2, "a"', encoding="utf-8")
    assert read_metrics(tmp_path) == [{"step": 1, "a": 1.0}]
    with MetricsLogger(tmp_path, tensorboard_enabled=False) as logger:
        logger.log(2, {"a": 2.0})
    assert read_metrics(tmp_path) == [{"step": 1, "a": 1.0}, {"step": 2, "a": 2.0}]


def test_tensorboard_event_file_only_when_enabled(tmp_path: Path) -> None:
    on_dir, off_dir = tmp_path / "on", tmp_path / "off"
    with MetricsLogger(on_dir, tensorboard_enabled=True, run_config={"lr": 1e-6}) as logger:
        logger.log(1, {"train/reward": 0.5, "train/kl": math.nan})
    events = _tb_events(on_dir)
    assert events and all(path.stat().st_size > 0 for path in events)
    assert json.loads((on_dir / "run_config.json").read_text(encoding="utf-8")) == {"lr": 1e-6}

    with MetricsLogger(off_dir, tensorboard_enabled=False) as logger:
        logger.log(1, {"train/reward": 0.5})
    assert _tb_events(off_dir) == []
    assert (off_dir / "metrics.jsonl").exists()


def test_tensorboard_custom_dir(tmp_path: Path) -> None:
    tb_dir = tmp_path / "tb"
    with MetricsLogger(tmp_path / "run", tensorboard_enabled=True, tensorboard_dir=tb_dir) as logger:
        logger.log(1, {"train/reward": 0.5})
    assert _tb_events(tb_dir)
    assert _tb_events(tmp_path / "run") == []


def test_log_samples_content(tmp_path: Path) -> None:
    samples = [
        {"prompt": "1+1=", "response": "2", "reward": 1.0, "ground_truth": "2"},
        {"prompt": "2+2=", "response": "5", "reward": torch.tensor(0.0), "extra": {"score": math.nan}},
    ]
    with MetricsLogger(tmp_path, tensorboard_enabled=False) as logger:
        logger.log_samples(7, samples)
    rows = _lines(tmp_path / "samples.jsonl")
    assert rows == [
        {"step": 7, "prompt": "1+1=", "response": "2", "reward": 1.0, "ground_truth": "2"},
        {"step": 7, "prompt": "2+2=", "response": "5", "reward": 0.0, "extra": {"score": None}},
    ]


def test_close_is_idempotent(tmp_path: Path) -> None:
    logger = MetricsLogger(tmp_path, tensorboard_enabled=True)
    logger.log(0, {"train/reward": 1.0})
    logger.close()
    logger.close()
    assert read_metrics(tmp_path) == [{"step": 0, "train/reward": 1.0}]


def _write_run(log_dir: Path, *, with_val: bool, with_kl: bool, steps: int = 4) -> None:
    with MetricsLogger(log_dir, tensorboard_enabled=False) as logger:
        for step in range(1, steps + 1):
            metrics: dict[str, float] = {"train/reward": math.nan if step == 2 else step / steps}
            if with_kl:
                metrics["train/kl"] = 0.001 * step
            if with_val and step % 2 == 0:
                metrics["val/accuracy"] = 0.25 * step
            logger.log(step, metrics)


@pytest.mark.parametrize(("with_val", "with_kl"), [(True, True), (False, False), (True, False)])
def test_plot_run_writes_png(tmp_path: Path, with_val: bool, with_kl: bool) -> None:
    _write_run(tmp_path, with_val=with_val, with_kl=with_kl)
    out = plot_run(tmp_path)
    assert out == tmp_path / "plot.png"
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000


def test_plot_run_custom_out_single_point_and_empty(tmp_path: Path) -> None:
    _write_run(tmp_path / "one", with_val=True, with_kl=False, steps=1)
    out = plot_run(tmp_path / "one", tmp_path / "plots" / "one.png")
    assert out.read_bytes().startswith(PNG_MAGIC)
    (tmp_path / "empty").mkdir()
    assert plot_run(tmp_path / "empty").read_bytes().startswith(PNG_MAGIC)


def test_a_run_without_rewards_plots_its_train_loss(tmp_path: Path) -> None:
    """SFT (and DPO, reward models) log a loss and no reward: the first panel is the loss, not "no data"."""
    from rlfleet.logging.plot import run_figure

    sft = [{"step": s, "train/loss": 1.0 / s} for s in range(1, 6)] + [{"step": 5, "val/accuracy": 0.3}]
    top, val = run_figure(sft).axes
    assert (
        top.get_title() == "train loss" and len(top.lines) == 2 and val.get_title() == "validation accuracy"
    )
    grpo = [{"step": s, "train/reward": 0.1 * s, "train/loss": 0.5, "train/kl": 0.01} for s in range(1, 4)]
    titles = [ax.get_title() for ax in run_figure(grpo).axes]
    assert titles == ["train reward", "validation accuracy", "train KL"]
    assert run_figure([{"step": 1, "x": 1.0}]).axes[0].get_title() == "train reward"  # no data


def test_stage_curves_put_the_stages_on_one_step_axis(tmp_path: Path) -> None:
    from rlfleet.logging.plot import plot_stages, stage_curves

    with MetricsLogger(tmp_path / "sft", tensorboard_enabled=False) as logger:
        for step, acc in ((0, 0.01), (60, 0.03), (120, 0.05)):
            logger.log(step, {"val/accuracy": acc, "train/loss": 1.0} if step else {"val/accuracy": acc})
    with MetricsLogger(tmp_path / "grpo", tensorboard_enabled=False) as logger:
        logger.log(0, {"val/accuracy": 0.05})
        for step in range(1, 5):
            logger.log(step, {"train/reward": 0.1, **({"val/accuracy": 0.08} if step == 4 else {})})
    stages = [("SFT", tmp_path / "sft"), ("GRPO", tmp_path / "grpo")]
    (sft, *sft_curve, sft_start), (grpo, *grpo_curve, grpo_start) = stage_curves(stages)
    assert (sft, sft_start, grpo, grpo_start) == ("SFT", 0.0, "GRPO", 120.0)
    np.testing.assert_array_equal(sft_curve[0], [0, 60, 120])
    np.testing.assert_array_equal(grpo_curve[0], [120, 124])  # GRPO's step 0 is SFT's last step
    np.testing.assert_array_equal(grpo_curve[1], [0.05, 0.08])
    out = plot_stages(stages, tmp_path / "curve.png", "title")
    assert out.read_bytes().startswith(PNG_MAGIC)
    (tmp_path / "none").mkdir()
    assert (
        plot_stages([("SFT", tmp_path / "none")], tmp_path / "empty.png").read_bytes().startswith(PNG_MAGIC)
    )


def test_moving_average() -> None:
    np.testing.assert_allclose(moving_average(np.array([1.0, 3.0, 5.0, 7.0]), 2), [1.0, 2.0, 4.0, 6.0])
    assert moving_average(np.array([]), 3).size == 0


FULL_METRICS = {
    "train/reward": 0.4375,
    "train/accuracy": 0.5,
    "train/kl": 0.0012,
    "train/loss": -0.0131,
    "train/grad_norm": 0.8213,
    "train/num_tokens": 4312,
    "timing/total": 3.21,
    "timing/generation": 1.9,
    "timing/env": 0.01,
    "timing/logprobs": 0.3,
    "timing/training": 0.94,
    "timing/checkpoint": 0.0,
}


def test_format_step_line_full() -> None:
    line = format_step_line(12, 100, FULL_METRICS)
    assert line == (
        "step 12/100 | reward 0.438 | acc 0.500 | kl 0.0012 | loss -0.0131 | gnorm 0.82 | tok 4,312 | "
        "time 3.2s (gen 1.9 env 0.0 lp 0.3 train 0.9 ckpt 0.0, slowest gen 59%)"
    )
    with_mfu = format_step_line(12, 100, {**FULL_METRICS, "perf/training_mfu": 0.4123})
    assert with_mfu == line + " | mfu 41.2%"
    with_val = format_step_line(12, 100, {**FULL_METRICS, "val/accuracy": 0.53})
    assert with_val == line + " | val_acc 0.530"


def test_format_step_line_partial() -> None:
    line = format_step_line(3, 10, {"train/reward": 1.0, "timing/total": 0.5, "val/accuracy": None})
    assert line == "step 3/10 | reward 1.000 | time 0.5s"
    assert format_step_line(1, 5, {}) == "step 1/5"
    assert format_step_line(2, 5, {"timing/generation": 1.25}) == "step 2/5 | time (gen 1.2)"


def test_progress_disabled_prints_lines(capsys: pytest.CaptureFixture[str]) -> None:
    with Progress(total=10, initial=2, desc="train", enabled=False) as progress:
        assert not progress.bar_active
        progress.update()
        progress.set_postfix(reward=0.5)
        progress.write("step 3/10 | reward 0.500")
        assert progress.n == 3
    assert capsys.readouterr().out == "step 3/10 | reward 0.500\n"


def test_progress_non_tty_still_prints(capsys: pytest.CaptureFixture[str]) -> None:
    progress = Progress(total=4, initial=0, desc="train", enabled=True)  # pytest's stderr is not a TTY
    assert not progress.bar_active
    progress.write("hello")
    progress.close()
    assert "hello" in capsys.readouterr().out


def test_truncate_after_with_tensorboard_enabled(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, tensorboard_enabled=True) as logger:
        for step in range(1, 4):
            logger.log(step, {"train/reward": float(step)})
    with MetricsLogger(tmp_path, tensorboard_enabled=True) as logger:
        logger.truncate_after(1)
        logger.log(2, {"train/reward": 20.0})
    assert read_metrics(tmp_path) == [{"step": 1, "train/reward": 1.0}, {"step": 2, "train/reward": 20.0}]
    assert _tb_events(tmp_path / "tensorboard")


def test_step_line_shows_refit_only_when_it_took_time() -> None:
    fast = format_step_line(1, 2, {"timing/training": 1.0, "timing/refit": 0.001})
    slow = format_step_line(1, 2, {"timing/training": 1.0, "timing/refit": 0.25})
    assert "refit" not in fast
    assert slow.endswith("(train 1.0 refit 0.2)")


def test_the_step_line_shows_the_validation_time_beside_its_accuracy() -> None:
    line = format_step_line(
        10, 60, {"timing/total": 27.2, "val/accuracy": 0.28125, "timing/validation": 8.04}
    )
    assert line.endswith("| val_acc 0.281 (8.0s)")
    assert format_step_line(0, 60, {"val/accuracy": 0.078125}) == "step 0/60 | val_acc 0.078"


def test_a_step_line_for_validations_and_the_last_step_only_under_a_bar() -> None:
    from rlfleet.logging.console import prints_step_line

    printed = [s for s in range(1, 481) if prints_step_line(s, 480, validated=s % 40 == 0, bar_active=True)]
    assert printed == [*range(40, 481, 40)]  # the validations, the last step among them
    assert prints_step_line(7, 480, validated=False, bar_active=True) is False
    assert prints_step_line(480, 480, validated=False, bar_active=True) is True


def test_without_a_bar_about_twenty_step_lines_per_run(capsys: pytest.CaptureFixture[str]) -> None:
    with Progress(total=100, desc="train", enabled=False) as progress:
        for step in range(1, 101):
            progress.step_done(step, {"train/reward": 0.5}, validated=step == 50)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 20 and lines[-1] == "step 100/100 | reward 0.500"
    assert all(line.startswith("step ") for line in lines)
