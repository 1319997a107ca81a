"""End-to-end reward-model training with the tiny model loaded as a sequence classifier: the pair accuracy
rises, packing gives the update of padded rows, a killed run resumes exactly, and the export is a
transformers sequence classifier that the ``reward_model`` environment reads with the trained scores."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from rlfleet.algorithms.rm.loop import RM
from rlfleet.checkpoint import export_hf
from rlfleet.config import MasterConfig, load_recipe, quote_override_value, resolve_recipe_path
from rlfleet.data.arithmetic import write_arithmetic_pairs
from rlfleet.data.preferences import PreferenceExample, tokenize_pairs
from rlfleet.environments.reward_model import RewardModelEnvironment
from rlfleet.logging import read_metrics
from rlfleet.policy.logprobs import token_scores
from rlfleet.policy.loss_math import last_token_index
from tests.conftest import assert_resumed_run_matches, kill_in_step, trainer_params


def small_pairs(directory: Path) -> Path:
    """16 pairs of `rlfleet data arithmetic-pairs`: a worked answer chosen, a slip in its last step
    rejected."""
    train, _ = write_arithmetic_pairs(directory, num_train=16, num_val=4, seed=3, max_operand=9)
    return train


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_pairs(tmp_path_factory.mktemp("pairs"))


def small_rm_config(model_dir: Path, run_dir: Path, pairs: Path, *extra: str) -> MasterConfig:
    """The shipped tiny RM recipe at a unit-test size, validated on its own training pairs."""
    return load_recipe(
        resolve_recipe_path("rm-tiny-arithmetic-cpu"),
        [
            f"policy.model_name={quote_override_value(str(model_dir))}",
            f"checkpointing.checkpoint_dir={quote_override_value(str(run_dir / 'ckpt'))}",
            f"logger.log_dir={quote_override_value(str(run_dir / 'logs'))}",
            f"data.train_data_path={quote_override_value(str(pairs))}",
            f"data.val_data_path={quote_override_value(str(pairs))}",
            "logger.tensorboard_enabled=false",
            "logger.progress_bar=false",
            "rm.max_num_steps=2",
            "rm.val_period=2",
            "rm.val_global_batch_size=8",
            "rm.val_micro_batch_size=4",
            "rm.val_at_start=false",
            "rm.val_at_end=false",
            "policy.train_global_batch_size=4",
            "policy.train_micro_batch_size=2",
            "policy.optimizer.kwargs.lr=3.0e-3",
            "policy.scheduler.warmup_steps=0",
            "checkpointing.save_period=2",
            "checkpointing.keep_top_k=null",
            *extra,
        ],
    )


@pytest.mark.learning
def test_pair_accuracy_rises_on_the_training_pairs(tiny_model_dir: Path, tmp_path: Path, pairs: Path) -> None:
    extra = ("rm.max_num_steps=8", "rm.max_num_epochs=2", "rm.val_period=8", "rm.val_at_start=true")
    trainer = RM(small_rm_config(tiny_model_dir, tmp_path, pairs, *extra))
    before = trainer_params(trainer)
    trainer.train()
    records = read_metrics(tmp_path / "logs")
    start, end = records[0], records[-1]
    assert start["step"] == 0 and end["step"] == 8
    assert start["val/num_valid_samples"] == 16
    # 16 pairs give the accuracy in steps of 1/16, and a random head may rank most of them right already
    # (14 of 16 at one of seven seeds): the loss over the same pairs carries the claim, lowered by 0.02 to
    # 0.10 at each seed, the same under each CPU kernel (`make test-learning-kernels`); an RM that does not
    # learn leaves it at its start. The trained head ranks the pairs better than chance.
    assert end["val/loss"] < start["val/loss"] - 0.01
    assert end["val/accuracy"] > 0.5
    assert end["val/rewards_chosen_mean"] > end["val/rewards_rejected_mean"]
    assert end["train/num_pairs"] == 4 and end["train/num_valid_samples"] == 4
    after = trainer_params(trainer)
    assert not torch.equal(after["score.weight"], before["score.weight"])  # the new head trains
    assert not torch.equal(
        after["model.layers.0.mlp.up_proj.weight"], before["model.layers.0.mlp.up_proj.weight"]
    )


def test_packed_pairs_give_the_update_of_padded_ones(
    tiny_model_dir: Path, tmp_path: Path, pairs: Path
) -> None:
    runs = {}
    layouts = {
        "padded": ("policy.train_micro_batch_size=4",),
        "packed": ("policy.sequence_packing.enabled=true", "policy.sequence_packing.train_mb_tokens=320"),
    }
    for name, layout in layouts.items():
        trainer = RM(small_rm_config(tiny_model_dir, tmp_path / name, pairs, "rm.val_period=0", *layout))
        trainer.train()
        runs[name] = (trainer_params(trainer), read_metrics(tmp_path / name / "logs")[-1])
    (padded, padded_metrics), (packed, packed_metrics) = runs["padded"], runs["packed"]
    assert packed_metrics["train/loss"] == pytest.approx(padded_metrics["train/loss"], abs=1e-5)
    assert abs(padded_metrics["train/loss"] - 0.693147) > 1e-3  # the second step moved off the first's
    for name, p in padded.items():
        # AdamW's per-weight normalisation turns float rounding into ~1e-5 of an lr-3e-3 update
        torch.testing.assert_close(packed[name], p, rtol=1e-4, atol=2e-5, msg=name)


def test_killed_rm_run_resumes_to_identical_weights_and_metrics(
    tiny_model_dir: Path, tmp_path: Path, pairs: Path
) -> None:
    extra = ("rm.max_num_steps=4",)
    full = RM(small_rm_config(tiny_model_dir, tmp_path / "full", pairs, *extra))
    full.train()
    kill_in_step(RM(small_rm_config(tiny_model_dir, tmp_path / "resumed", pairs, *extra)), 3)
    resumed = RM(small_rm_config(tiny_model_dir, tmp_path / "resumed", pairs, *extra))
    assert resumed.ctx.step == 2
    resumed.train()
    assert_resumed_run_matches(full, resumed, tmp_path / "full", tmp_path / "resumed")


def test_the_export_is_a_sequence_classifier_the_reward_model_environment_reads(
    tiny_model_dir: Path, tmp_path: Path, pairs: Path
) -> None:
    trainer = RM(small_rm_config(tiny_model_dir, tmp_path, pairs, "rm.val_period=0"))
    trainer.train()
    out = export_hf(tmp_path / "ckpt" / "step_2", tmp_path / "export")
    exported = AutoModelForSequenceClassification.from_pretrained(out).eval()
    trained = trainer.ctx.policy.model.eval()
    assert exported.config.num_labels == 1
    assert exported.config.pad_token_id == trainer.ctx.policy.tokenizer.pad_token_id

    env = RewardModelEnvironment({"model_name": str(out), "precision": "float32", "batch_size": 2})
    logs = [
        [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": f"#### {n}"}]
        for n in (5, 6, 17)
    ]
    env_scores, _ = env.scorer.score(logs)
    rows = [env.scorer.ids(log) for log in logs]
    width = max(len(r) for r in rows)
    pad = trainer.ctx.policy.tokenizer.pad_token_id
    input_ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    with torch.no_grad():
        scores = token_scores(trained, input_ids, attention_mask=mask)
        mine = scores[torch.arange(len(rows)), last_token_index(input_ids, mask, pad)]
        theirs = exported(input_ids=input_ids, attention_mask=mask).logits[:, 0]
    torch.testing.assert_close(theirs, mine, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.tensor(env_scores), mine, rtol=1e-5, atol=1e-5)
    assert len(set(env_scores)) == 3  # the replies score apart
    # the environment reads the score on the tokens training read it on (a pair's prompt + reply, its EOS
    # last), not on the chat template's trailing newline after EOS
    user, (right, wrong) = logs[0][0], (log[1] for log in logs[:2])
    example = PreferenceExample((user,), (right,), (wrong,), "t")
    (pair,), _ = tokenize_pairs([example], trainer.ctx.policy.tokenizer, max_total_length=160)
    assert env.scorer.ids(logs[0]) == [*pair.prompt_ids, *pair.chosen_ids]


def test_the_recipe_names_the_command_that_writes_its_pairs_then_validates(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from rlfleet.cli import main

    monkeypatch.chdir(tmp_path)
    model = f"policy.model_name={tiny_model_dir}"
    assert main(["validate", "rm-tiny-arithmetic-cpu", model]) == 2
    assert "`rlfleet data arithmetic-pairs runs/demo/rm/pairs` writes it" in capsys.readouterr().err
    assert main(["data", "arithmetic-pairs", "runs/demo/rm/pairs", "--num-train", "8", "--num-val", "4"]) == 0
    assert len((tmp_path / "runs/demo/rm/pairs/val.jsonl").read_text().splitlines()) == 4
    assert main(["validate", "rm-tiny-arithmetic-cpu", model]) == 0
    assert "reward_model_cfg:\n    enabled: true" in capsys.readouterr().out
