"""End-to-end GRPO with a tiny model: parameters move, resume is exact, micro-batching is invariant."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from rlfleet.algorithms.grpo.loop import GRPO
from rlfleet.logging import read_metrics
from rlfleet.policy.batch import collate
from rlfleet.policy.loss_functions import ClippedPGLossFn
from rlfleet.policy.parallelize import is_checkpointed
from tests.conftest import (
    assert_resumed_run_matches,
    comparable_metrics,
    count_logprob_passes,
    kill_in_step,
    small_grpo_config,
    trainer_params,
)

DENSE = "env.math.reward_fn=tests.functional.rewards_for_tests.digit_fraction_reward"


def test_two_grpo_steps_change_every_trainable_parameter(tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = small_grpo_config(tiny_model_dir, tmp_path, "grpo.max_num_steps=2", DENSE)
    trainer = GRPO(cfg)
    before = trainer_params(trainer)
    trainer.train()
    after = trainer_params(trainer)
    unchanged = [n for n in before if torch.equal(before[n], after[n])]
    assert not unchanged, f"parameters not updated: {unchanged}"
    records = read_metrics(tmp_path / "logs")
    assert [r["step"] for r in records] == [0, 1, 2]
    assert records[1]["train/zero_variance_groups"] < 1.0
    assert (tmp_path / "logs" / "plot.png").stat().st_size > 0
    assert (tmp_path / "ckpt" / "step_2" / "policy" / "weights" / "__0_0.distcp").is_file()


def test_killed_run_resumes_to_identical_weights_and_metrics(tiny_model_dir: Path, tmp_path: Path) -> None:
    extra = ("grpo.max_num_steps=4", DENSE)
    full = GRPO(small_grpo_config(tiny_model_dir, tmp_path / "full", *extra))
    full.train()

    interrupted = GRPO(small_grpo_config(tiny_model_dir, tmp_path / "resumed", *extra))
    kill_in_step(interrupted, 3)  # after the step-2 checkpoint, in the middle of step 3

    resumed = GRPO(small_grpo_config(tiny_model_dir, tmp_path / "resumed", *extra))
    assert resumed.ctx.step == 2
    resumed.train()

    assert_resumed_run_matches(full, resumed, tmp_path / "full", tmp_path / "resumed")

    # A finished run started again does nothing and keeps its results.
    again = GRPO(small_grpo_config(tiny_model_dir, tmp_path / "resumed", *extra))
    again.train()
    assert comparable_metrics(read_metrics(tmp_path / "resumed" / "logs")) == comparable_metrics(
        read_metrics(tmp_path / "full" / "logs")
    )


def test_partial_tmp_checkpoint_is_ignored(tiny_model_dir: Path, tmp_path: Path, caplog) -> None:
    extra = ("grpo.max_num_steps=2", DENSE)
    GRPO(small_grpo_config(tiny_model_dir, tmp_path, *extra)).train()
    (tmp_path / "ckpt" / "tmp_step_4" / "policy").mkdir(parents=True)
    with caplog.at_level("WARNING"):
        trainer = GRPO(small_grpo_config(tiny_model_dir, tmp_path, "grpo.max_num_steps=3", DENSE))
    assert trainer.ctx.step == 2
    assert "tmp_step_4" in caplog.text


@pytest.mark.parametrize("token_level", [True, False])
def test_micro_batch_1_x_8_equals_8_x_1(tiny_model_dir: Path, tmp_path: Path, token_level: bool) -> None:
    cfg = small_grpo_config(tiny_model_dir, tmp_path, DENSE)
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(5, 300, (int(n),), generator=g).tolist() for n in torch.randint(3, 9, (8,), generator=g)
    ]
    responses = [
        torch.randint(5, 300, (int(n),), generator=g).tolist() for n in torch.randint(1, 7, (8,), generator=g)
    ]
    loss = ClippedPGLossFn(0.2, 0.2, None, 0.05, 20.0, 10.0, token_level, False)
    results = []
    for micro in (1, 8):
        trainer = GRPO(cfg)
        worker = trainer.ctx.policy
        batch = collate(prompts, responses, worker.tokenizer.pad_token_id)
        prev = worker.logprobs(batch, 8)
        batch = batch.with_(
            advantages=torch.randn(8, generator=torch.Generator().manual_seed(1)),
            prev_logprobs=prev - 0.05,
            ref_logprobs=prev + 0.1,
        )
        metrics = worker.train(batch, loss, global_batch_size=8, micro_batching=micro)
        results.append((metrics, {n: p.detach().clone() for n, p in worker.model.named_parameters()}))
    (m1, p1), (m8, p8) = results
    assert m1["loss"] == pytest.approx(m8["loss"], rel=1e-5, abs=1e-7)
    assert m1["grad_norm"] == pytest.approx(m8["grad_norm"], rel=1e-4)
    for name in p1:
        torch.testing.assert_close(p1[name], p8[name], rtol=1e-5, atol=1e-6, msg=name)


def test_samples_and_metrics_files_are_readable(tiny_model_dir: Path, tmp_path: Path) -> None:
    GRPO(small_grpo_config(tiny_model_dir, tmp_path, "grpo.max_num_steps=1", DENSE)).train()
    samples = [json.loads(line) for line in (tmp_path / "logs" / "samples.jsonl").read_text().splitlines()]
    assert samples and {"prompt", "response", "gold", "reward", "step"} <= set(samples[0])
    last = read_metrics(tmp_path / "logs")[-1]
    for key in (
        "train/reward",
        "train/loss",
        "train/kl",
        "train/grad_norm",
        "timing/generation",
        "timing/env",
        "timing/logprobs",
        "timing/training",
        "val/accuracy",
    ):
        assert key in last, key
    # the trainer's resident memory now and at its peak during the step (issue 20)
    assert 0 < last["memory/trainer_rss_gib"] <= last["memory/trainer_peak_rss_gib"] < 64
    # and the processes it started (the math environment's workers here), where the kernel lists children
    if Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").exists():
        assert 0 < last["memory/children_rss_gib"] <= last["memory/children_peak_rss_gib"]


def test_activation_checkpointing_gives_the_same_update(tiny_model_dir: Path, tmp_path: Path) -> None:
    params = []
    for flag in ("false", "true"):
        trainer = GRPO(
            small_grpo_config(
                tiny_model_dir,
                tmp_path / flag,
                "grpo.max_num_steps=1",
                "grpo.val_at_start=false",
                "grpo.val_at_end=false",
                DENSE,
                f"policy.dtensor_cfg.activation_checkpointing={flag}",
            )
        )
        assert is_checkpointed(trainer.ctx.policy.model) == (flag == "true")
        trainer.train()
        params.append(trainer_params(trainer))
    for name, value in params[0].items():
        torch.testing.assert_close(params[1][name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_kill_between_checkpoint_and_log_line_loses_no_metrics(tiny_model_dir: Path, tmp_path: Path) -> None:
    extra = ("grpo.max_num_steps=3", DENSE)
    GRPO(small_grpo_config(tiny_model_dir, tmp_path / "full", *extra)).train()

    interrupted = GRPO(small_grpo_config(tiny_model_dir, tmp_path / "resumed", *extra))
    original_log = interrupted.ctx.logger.log

    def die_on_step_two(step: int, metrics: dict) -> None:
        if step == 2:  # step_2 is on disk; its metrics.jsonl line is not
            raise KeyboardInterrupt("simulated kill")
        original_log(step, metrics)

    interrupted.ctx.logger.log = die_on_step_two  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        interrupted.train()
    assert (tmp_path / "resumed" / "ckpt" / "step_2").is_dir()
    assert 2 not in [r["step"] for r in read_metrics(tmp_path / "resumed" / "logs")]

    GRPO(small_grpo_config(tiny_model_dir, tmp_path / "resumed", *extra)).train()
    assert comparable_metrics(read_metrics(tmp_path / "resumed" / "logs")) == comparable_metrics(
        read_metrics(tmp_path / "full" / "logs")
    )


ON_POLICY = (
    "grpo.max_num_steps=1",
    "grpo.val_at_start=false",
    "grpo.val_at_end=false",
    "policy.train_global_batch_size=16",  # the step's 4 x 4 rows: one optimizer step
    "policy.train_micro_batch_size=4",
    DENSE,
)


@pytest.mark.parametrize("logprob_batch_size", [4, 16])
def test_on_policy_step_without_the_prev_pass_gives_the_same_update(
    tiny_model_dir: Path, tmp_path: Path, logprob_batch_size: int
) -> None:
    runs = []
    for always_compute_prev in (False, True):
        run_dir = tmp_path / str(always_compute_prev)
        cfg = small_grpo_config(
            tiny_model_dir, run_dir, *ON_POLICY, f"policy.logprob_batch_size={logprob_batch_size}"
        )
        trainer = GRPO(cfg, always_compute_prev=always_compute_prev)
        calls = count_logprob_passes(trainer)
        trainer.train()
        assert calls == ([False, True] if always_compute_prev else [True])  # (prev,) reference
        runs.append((trainer_params(trainer), read_metrics(run_dir / "logs")[-1]))
    (skipped, m_skipped), (computed, m_computed) = runs
    for name, value in computed.items():
        torch.testing.assert_close(skipped[name], value, rtol=0, atol=1e-6, msg=name)
    for key in ("loss", "kl", "ratio", "clip_fraction", "grad_norm", "gen_logprob_error"):
        assert m_skipped[f"train/{key}"] == pytest.approx(m_computed[f"train/{key}"], rel=1e-5, abs=1e-7), key
    assert m_skipped["train/ratio"] == 1.0
    assert m_skipped["train/reward"] == m_computed["train/reward"]  # the same rollouts


def test_no_logprob_pass_at_all_without_kl_penalty(tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = small_grpo_config(tiny_model_dir, tmp_path, *ON_POLICY, "loss_fn.reference_policy_kl_penalty=0")
    trainer = GRPO(cfg)
    assert not trainer.ctx.policy.has_reference  # the reference is not even built
    calls = count_logprob_passes(trainer)
    trainer.train()
    assert calls == []
    last = read_metrics(tmp_path / "logs")[-1]
    assert last["train/kl"] == 0.0
    assert 0.0 <= last["train/gen_logprob_error"] < 0.05  # HF generation scores match the training forward
