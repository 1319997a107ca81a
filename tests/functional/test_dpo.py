"""End-to-end DPO with the tiny model: pairs from its own samples, NeMo RL's first-step check, exact
resume, and the same update whatever the micro-batching."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlfleet.algorithms.dpo.loop import DPO
from rlfleet.config import MasterConfig, load_recipe, quote_override_value, resolve_recipe_path
from rlfleet.data.arithmetic import generate_arithmetic
from rlfleet.logging import read_metrics
from tests.conftest import assert_resumed_run_matches, kill_in_step, trainer_params

DENSE = "env.math.reward_fn=tests.functional.rewards_for_tests.digit_fraction_reward"


def small_dpo_config(model_dir: Path, run_dir: Path, *extra: str) -> MasterConfig:
    """The shipped tiny DPO recipe at a unit-test size (pairs from a dense reward: a random model's
    samples differ in it, so every prompt gives a pair)."""
    return load_recipe(
        resolve_recipe_path("dpo-tiny-arithmetic-cpu"),
        [
            f"policy.model_name={quote_override_value(str(model_dir))}",
            f"checkpointing.checkpoint_dir={quote_override_value(str(run_dir / 'ckpt'))}",
            f"logger.log_dir={quote_override_value(str(run_dir / 'logs'))}",
            "logger.tensorboard_enabled=false",
            "logger.progress_bar=false",
            "dpo.sampled_pairs.num_generations_per_prompt=4",
            "dpo.max_val_samples=8",
            "dpo.val_period=2",
            "dpo.max_num_steps=2",
            "policy.train_global_batch_size=4",
            "policy.train_micro_batch_size=2",
            "policy.logprob_batch_size=8",
            "policy.generation.max_new_tokens=12",
            "policy.optimizer.kwargs.lr=1.0e-3",
            "data.arithmetic.num_train=64",
            "data.arithmetic.num_val=8",
            "checkpointing.save_period=2",
            "checkpointing.keep_top_k=null",
            "env.math.num_workers=1",
            DENSE,
            *extra,
        ],
    )


def test_first_step_loss_is_ln2_and_training_moves_the_policy_off_its_reference(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """NeMo RL's functional DPO check: the first step's loss lies in (0.69314, 0.69316) (policy ==
    reference); then the policy moves off its reference. Each step's pairs are new samples, four of them:
    whether the two small updates before step 3 rank its pairs right was a coin toss across seeds (2 of 6
    wrong), so DPO's learning is asserted on fixed held-out pairs, in the preference-dataset test below."""
    trainer = DPO(small_dpo_config(tiny_model_dir, tmp_path, "dpo.max_num_steps=3"))
    before = trainer_params(trainer)
    trainer.train()
    records = [r for r in read_metrics(tmp_path / "logs") if "train/loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3]
    first, last = records[0], records[-1]
    assert 0.69314 < first["train/loss"] < 0.69316
    assert first["train/num_pairs"] == 4 and first["train/num_valid_samples"] == 4
    assert last["train/rewards_chosen_mean"] != 0.0 and last["train/rewards_rejected_mean"] != 0.0
    assert last["train/loss"] != pytest.approx(0.693147, abs=1e-5)  # 1.6e-4 to 1.5e-3 off it over seeds
    assert any(not torch.equal(before[n], p) for n, p in trainer_params(trainer).items())
    assert "val/accuracy" in read_metrics(tmp_path / "logs")[0]


def test_killed_dpo_run_resumes_to_identical_weights_and_metrics(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    extra = (  # with the overlong penalty ranking the samples: the pairs it picks are resumed as well
        "dpo.max_num_steps=4",
        "dpo.sampled_pairs.reward_shaping.enabled=true",
        "dpo.sampled_pairs.reward_shaping.overlong_buffer_length=4",
    )
    full = DPO(small_dpo_config(tiny_model_dir, tmp_path / "full", *extra))
    full.train()
    steps = [r for r in read_metrics(tmp_path / "full" / "logs") if "train/loss" in r]
    assert all(0 <= r["train/length_only_pairs"] <= r["train/num_pairs"] for r in steps)
    interrupted = DPO(small_dpo_config(tiny_model_dir, tmp_path / "resumed", *extra))
    kill_in_step(interrupted, 3)
    resumed = DPO(small_dpo_config(tiny_model_dir, tmp_path / "resumed", *extra))
    assert resumed.ctx.step == 2
    resumed.train()
    assert_resumed_run_matches(full, resumed, tmp_path / "full", tmp_path / "resumed")


@pytest.mark.parametrize(
    "layout",
    [
        ("policy.train_micro_batch_size=1",),
        ("policy.sequence_packing.enabled=true", "policy.sequence_packing.train_mb_tokens=320"),
        ("policy.dynamic_batching.enabled=true", "policy.dynamic_batching.train_mb_tokens=384"),
    ],
    ids=["one-pair", "packed", "dynamic"],
)
def test_micro_batching_in_pairs_gives_the_same_update(
    tiny_model_dir: Path, tmp_path: Path, layout: tuple[str, ...]
) -> None:
    """Two steps with all pairs in one micro-batch, then with each alternative layout: the same losses and
    weights (float rounding aside); the second step's loss is not ln 2, so a split pair would show."""
    runs = {}
    for name, extra in (("whole", ("policy.train_micro_batch_size=4",)), ("other", layout)):
        beta = "dpo.reference_policy_kl_penalty=1.0"  # the second step far enough from ln 2
        trainer = DPO(small_dpo_config(tiny_model_dir, tmp_path / name, "dpo.val_period=0", beta, *extra))
        trainer.train()
        runs[name] = (trainer_params(trainer), read_metrics(tmp_path / name / "logs")[-1])
    (whole, whole_metrics), (other, other_metrics) = runs["whole"], runs["other"]
    assert abs(whole_metrics["train/loss"] - 0.693147) > 1e-3
    assert other_metrics["train/loss"] == pytest.approx(whole_metrics["train/loss"], abs=1e-5)
    for name, p in whole.items():
        torch.testing.assert_close(other[name], p, rtol=1e-4, atol=1e-6, msg=name)


def write_pairs(path: Path, count: int, offset: int = 0) -> Path:
    """Arithmetic preference rows: the worked answer chosen, a wrong final answer rejected; half in the
    binary format, half in NeMo RL's ranked-completions format (a file may mix them)."""
    a = MasterConfig().data.arithmetic
    rows = []
    problems = generate_arithmetic(
        count,
        seed=offset,
        min_ops=a.min_ops,
        max_ops=a.max_ops,
        max_operand=a.max_operand,
        operations=a.operations,
    )
    for i, ex in enumerate(problems):
        wrong = f"The answer is {int(ex.gold) + 1}.\n#### {int(ex.gold) + 1}"
        if i % 2:
            rows.append({"prompt": ex.question, "chosen": ex.answer, "rejected": wrong})
        else:
            user = [{"role": "user", "content": ex.question}]
            rows.append(
                {
                    "context": user,
                    "completions": [
                        {"rank": 1, "completion": [{"role": "assistant", "content": wrong}]},
                        {"rank": 0, "completion": [{"role": "assistant", "content": ex.answer}]},
                    ],
                }
            )
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.learning
def test_dpo_on_a_preference_dataset_validates_its_loss_and_pair_accuracy(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    train = write_pairs(tmp_path / "train.jsonl", 16)
    val = write_pairs(tmp_path / "val.jsonl", 6, offset=1)
    cfg = small_dpo_config(
        tiny_model_dir,
        tmp_path,
        "data.dataset_name=PreferenceDataset",
        f"data.train_data_path={train}",
        f"data.val_data_path={val}",
        "dpo.val_global_batch_size=4",
        "dpo.val_batches=2",
        "dpo.val_micro_batch_size=2",
        "dpo.reference_policy_kl_penalty=1.0",
        "checkpointing.metric_name=val:loss",
        "checkpointing.higher_is_better=false",
    )
    DPO(cfg).train()
    records = read_metrics(tmp_path / "logs")
    start, end = records[0], records[-1]
    assert start["val/num_valid_samples"] == 6  # two batches of at most 4 pairs: all 6
    assert 0.69314 < start["val/loss"] < 0.69316  # the policy is its reference
    # held-out pairs, chosen pulled above rejected: the loss fell to 0.38-0.39 at each of seven seeds
    assert end["val/loss"] < start["val/loss"] - 0.1
    assert end["train/num_pairs"] == 4 and "train/sample_reward" not in end
    assert (tmp_path / "ckpt" / "step_2").is_dir()


def test_dpo_with_lora_starts_at_ln2_and_trains_only_the_adapters(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """With LoRA the reference is the model without its adapters (no second copy): the first loss is ln 2
    (B starts at zero), then only adapter weights move."""
    cfg = small_dpo_config(
        tiny_model_dir,
        tmp_path,
        "policy.dtensor_cfg.lora_cfg.enabled=true",
        "dpo.reference_policy_kl_penalty=1.0",
        "dpo.val_period=0",
    )
    trainer = DPO(cfg)
    before = trainer_params(trainer)
    trainer.train()
    records = [r for r in read_metrics(tmp_path / "logs") if "train/loss" in r]
    assert 0.69314 < records[0]["train/loss"] < 0.69316
    assert records[1]["train/loss"] != pytest.approx(0.693147, abs=1e-5)
    moved = {n for n, p in trainer_params(trainer).items() if not torch.equal(before[n], p)}
    assert moved and all("lora" in n for n in moved), sorted(moved)[:5]


def test_first_step_loss_is_ln2_in_bfloat16_too(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Under bfloat16 autocast the reference computes as the policy does, so the first step's log ratios
    are exactly 0 and the loss ln 2, whatever the responses' lengths (a reference in bfloat16 weights
    gave every pair a length-proportional offset: accuracy 1.0 and loss 0.67 at step 1 on SmolLM2)."""
    cfg = small_dpo_config(
        tiny_model_dir, tmp_path, "policy.precision=bfloat16", "dpo.max_num_steps=1", "dpo.val_period=0"
    )
    DPO(cfg).train()
    first = next(r for r in read_metrics(tmp_path / "logs") if "train/loss" in r)
    assert 0.69314 < first["train/loss"] < 0.69316
    assert first["train/rewards_chosen_mean"] == 0.0 and first["train/rewards_rejected_mean"] == 0.0
