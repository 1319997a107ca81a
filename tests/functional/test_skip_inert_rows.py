"""Rows whose loss is exactly zero are not computed, and the update is the same.

Without a KL term a row with advantage 0 (every row of a group whose rewards are all equal) adds exactly 0
to the loss and its gradient, yet it counts in the token-level normaliser. ``TrainBatch.inert`` marks such
rows; the workers count them in the ``Normalizer`` but plan no forward or backward pass for them. These
tests hold the update (loss, gradients, weights after AdamW) to the one computed over every row, in every
micro-batch layout, including a step whose rows are all inert (AdamW still steps on its moments: one
row is computed for its zero gradient and the metrics), and the
planning of data-parallel shards (equal forward passes, inert rows taken back only where needed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from rlfleet.algorithms.grpo.loop import inert_rows, trained_logprobs
from rlfleet.policy.batch import TrainBatch
from rlfleet.policy.microbatch import (
    MicroBatching,
    computed_rows,
    plan_micro_batches,
    plan_trained_micro_batches,
)
from rlfleet.policy.rank import PolicyRank
from tests.conftest import pg_loss
from tests.functional.test_packing import LAYOUTS, PADDED, make_batch, make_worker

ZERO_ROWS = (1, 2, 5, 6)  # two "flat groups" of two rows each, in the middle of the batch


def with_zero_advantages(batch: TrainBatch, rows: tuple[int, ...] = ZERO_ROWS) -> TrainBatch:
    assert batch.advantages is not None
    advantages = batch.advantages.clone()
    advantages[list(rows)] = 0.0
    return batch.with_(advantages=advantages)


def marked(batch: TrainBatch) -> TrainBatch:
    return batch.with_(inert=inert_rows(batch, kl_penalty=0.0))


def weights(worker: PolicyRank) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in worker.model.named_parameters()}


@pytest.mark.parametrize("layout", ["padded", *sorted(LAYOUTS)])
def test_skipping_zero_advantage_rows_gives_the_same_update(tiny_model_dir: Path, layout: str) -> None:
    batching = PADDED if layout == "padded" else LAYOUTS[layout]
    every_row, skipping = make_worker(tiny_model_dir), make_worker(tiny_model_dir)
    batch = with_zero_advantages(make_batch(every_row))
    loss_fn = pg_loss(kl_penalty=0.0)
    want = every_row.train(batch, loss_fn, global_batch_size=4, micro_batching=batching)
    got = skipping.train(marked(batch), loss_fn, global_batch_size=4, micro_batching=batching)
    for key in ("loss", "grad_norm", "lr"):
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-8), key
    theirs = weights(every_row)
    for name, p in weights(skipping).items():  # AdamW's first step: see test_packing
        torch.testing.assert_close(p, theirs[name], rtol=0, atol=2e-5, msg=name)


def test_a_step_of_only_inert_rows_still_steps_the_optimizer(tiny_model_dir: Path) -> None:
    """After one informative step, AdamW's moments move the weights even on a zero gradient: skipping
    every row of the next step must not skip that step."""
    every_row, skipping = make_worker(tiny_model_dir), make_worker(tiny_model_dir)
    batch = make_batch(every_row)
    flat = with_zero_advantages(batch, tuple(range(len(batch))))
    loss_fn = pg_loss(kl_penalty=0.0)
    for worker, second in ((every_row, flat), (skipping, marked(flat))):
        worker.train(batch, loss_fn, global_batch_size=8, micro_batching=PADDED)
        before = weights(worker)
        metrics = worker.train(second, loss_fn, global_batch_size=8, micro_batching=PADDED)
        assert metrics["grad_norm"] == 0.0 and metrics["loss"] == 0.0
        assert any(not torch.equal(p, before[n]) for n, p in weights(worker).items())
    theirs = weights(every_row)
    for name, p in weights(skipping).items():
        torch.testing.assert_close(p, theirs[name], rtol=0, atol=1e-7, msg=name)


def test_the_metrics_average_over_the_rows_computed(tiny_model_dir: Path) -> None:
    """``ratio`` and ``clip_fraction`` are means over the tokens the pass computed: skipping rows does not
    drag the mean ratio towards 0."""
    worker = make_worker(tiny_model_dir)
    batch = with_zero_advantages(make_batch(worker))
    metrics = worker.train(marked(batch), pg_loss(), global_batch_size=8, micro_batching=PADDED)
    assert metrics["ratio"] == pytest.approx(1.0, abs=0.2)


def test_a_step_that_trains_no_row_reports_no_ratio(tiny_model_dir: Path) -> None:
    """Every row inert: the one row computed for the zero gradient is not a mean over trained rows, so the
    step reports its loss but no ratio, clip fraction or generation-logprob error (they once came out as
    sums over that row: ratio 160, error 3-5 nats on SmolLM2's flat steps). Where only some optimizer steps
    of a GRPO step train, the means are over those steps."""
    worker = make_worker(tiny_model_dir)
    batch = make_batch(worker)
    generated = batch.with_(generation_logprobs=torch.zeros_like(batch.response_mask))
    flat = marked(with_zero_advantages(generated, tuple(range(len(batch)))))
    metrics = worker.train(flat, pg_loss(kl_penalty=0.0), global_batch_size=8, micro_batching=PADDED)
    assert metrics["loss"] == 0.0 and metrics["grad_norm"] == 0.0
    assert not {"ratio", "clip_fraction", "kl", "gen_logprob_error"} & set(metrics)
    half = marked(with_zero_advantages(generated, (4, 5, 6, 7)))  # second optimizer step: all inert
    both = make_worker(tiny_model_dir).train(
        half, pg_loss(kl_penalty=0.0), global_batch_size=4, micro_batching=PADDED
    )
    first = make_worker(tiny_model_dir).train(
        half.select(0, 4), pg_loss(kl_penalty=0.0), global_batch_size=4, micro_batching=PADDED
    )
    for key in ("ratio", "clip_fraction", "gen_logprob_error"):
        assert both[key] == pytest.approx(first[key], rel=1e-6), key


def test_with_a_kl_term_only_empty_rows_are_inert(tiny_model_dir: Path) -> None:
    worker = make_worker(tiny_model_dir)
    batch = with_zero_advantages(make_batch(worker))
    assert inert_rows(batch, kl_penalty=0.0).nonzero().flatten().tolist() == list(ZERO_ROWS)
    assert not inert_rows(batch, kl_penalty=0.01).any()
    emptied = batch.response_mask.clone()
    emptied[3] = 0.0
    assert inert_rows(batch.with_(response_mask=emptied), kl_penalty=0.01).nonzero().flatten().tolist() == [3]


@pytest.mark.parametrize("batching", [MicroBatching(rows=2), MicroBatching(rows=2, tokens=20, pack=True)])
def test_shards_plan_the_same_number_of_passes_without_inert_rows(batching: MicroBatching) -> None:
    lengths = [5, 7, 3, 9, 4, 6, 8, 2]
    trained = [True, True, True, True, False, False, False, True]  # shard 1 has one row to train
    plans = plan_trained_micro_batches(lengths, trained, batching, num_shards=2)
    assert len(plans[0]) == len(plans[1]) >= 1
    computed = [{i + s * 4 for group in plan for i in group} for s, plan in enumerate(plans)]
    assert computed[0] == {0, 1, 2, 3}
    # shard 1 computes its trained row, plus inert rows only to match shard 0's count of passes
    assert 7 in computed[1] and len(computed[1]) == len(plans[0])
    # no row to train: each shard computes its first row (a zero gradient the optimizer steps on)
    assert plan_trained_micro_batches(lengths, [False] * 8, batching, num_shards=2) == [[[0]], [[0]]]
    assert plan_trained_micro_batches(lengths, [True] * 8, batching, 2) == plan_micro_batches(
        lengths, batching, 2
    )


def test_logprob_passes_skip_inert_rows_and_keep_ranks_even(tiny_model_dir: Path) -> None:
    worker = make_worker(tiny_model_dir)
    batch = marked(with_zero_advantages(make_batch(worker)))
    assert computed_rows(batch, 1) == [0, 3, 4, 7]
    assert computed_rows(batch, 3) == [0, 1, 2, 3, 4, 7]  # two inert rows make six for three ranks
    seen: list[int] = []

    def logprobs(rows: TrainBatch) -> torch.Tensor:
        seen.append(len(rows))
        return worker.logprobs(rows, PADDED)

    got = trained_logprobs(batch, 1, logprobs)
    want = worker.logprobs(batch, PADDED)
    assert seen == [4]
    for row in range(len(batch)):
        expected = want[row] if row in (0, 3, 4, 7) else torch.zeros_like(want[row])
        torch.testing.assert_close(got[row], expected, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_a_grpo_step_skipping_flat_groups_equals_the_full_step(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The recipe key reaches the loop: half the groups are flat (their answer is odd), a separate prev
    pass (two optimizer steps), and the update equals the one that computes every row."""
    from rlfleet.algorithms.grpo.loop import GRPO
    from tests.conftest import small_grpo_config

    results = {}
    for skip in (False, True):
        cfg = small_grpo_config(
            tiny_model_dir,
            tmp_path / str(skip),
            "env.math.reward_fn=tests.functional.rewards_for_tests.digits_for_even_gold_reward",
            "grpo.max_num_steps=1",
            "grpo.val_at_start=false",
            "grpo.val_at_end=false",
            "checkpointing.enabled=false",
            "loss_fn.reference_policy_kl_penalty=0",
            f"grpo.skip_zero_advantage_rows={str(skip).lower()}",
            "policy.train_global_batch_size=8",
        )
        trainer = GRPO(cfg)
        results[skip] = (trainer.train(), weights(trainer.ctx.policy))
    (want, want_params), (got, params) = results[False], results[True]
    assert want["train/skipped_rows"] == 0.0 < got["train/skipped_rows"] < 1.0
    for key in ("train/loss", "train/grad_norm", "train/reward"):
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-8), key
    for name, value in want_params.items():
        torch.testing.assert_close(params[name], value, rtol=0, atol=2e-5, msg=name)


def train_on_two_ray_ranks(
    model_dir: Path, tensor_parallel_size: int, batch: TrainBatch, loss_fn: Any, batching: MicroBatching | int
) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """One ``train`` call of a batch of 8 (one optimizer step) on two ``ShardedPolicyRank`` Ray ranks:
    rank 0's metrics and the full state afterwards."""
    from rlfleet.distributed.cluster import create_node_placement_groups, remove_placement_groups
    from rlfleet.distributed.rank_group import RayRankGroup
    from rlfleet.models.loading import ModelSource
    from rlfleet.policy.sharded_rank import ShardedPolicyRank, ShardingSettings
    from tests.conftest import TEST_OPTIMIZER

    groups = create_node_placement_groups(num_nodes=1, bundles_per_node=2, use_gpus=False, timeout_s=30.0)
    init = {
        "source": ModelSource(str(model_dir)),
        "settings": TEST_OPTIMIZER,
        "sharding": ShardingSettings(tensor_parallel_size=tensor_parallel_size),
    }
    group = RayRankGroup(ShardedPolicyRank, groups, init, timeout_s=120.0)
    try:
        metrics = group.run_all("train", batch, loss_fn, global_batch_size=8, micro_batching=batching)
        state = group.run_all("full_state_dict")[0]
    finally:
        group.shutdown()
        remove_placement_groups(groups)
    return metrics[0], state


def assert_same_step(
    got: dict[str, float], state: dict[str, torch.Tensor], want: dict[str, float], single: PolicyRank
) -> None:
    for key in ("loss", "grad_norm"):
        assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-7), key
    for name, p in single.model.named_parameters():
        torch.testing.assert_close(state[name], p.detach(), rtol=0, atol=2e-5, msg=name)


@pytest.mark.slow
def test_two_fsdp_ranks_skipping_rows_equal_one_process_computing_all(
    ray_cluster: None, tiny_model_dir: Path
) -> None:
    """The sharded worker plans through the same code: rank 1 holds one trainable row, rank 0 three; both
    run as many forward passes (rank 1 takes an inert row back), and the update equals one process that
    computes every row."""
    single = make_worker(tiny_model_dir)
    batch = with_zero_advantages(make_batch(single), (1, 4, 5, 6))  # rank 0: rows 0-3, rank 1: rows 4-7
    loss_fn = pg_loss(kl_penalty=0.0)
    want = single.train(batch, loss_fn, global_batch_size=8, micro_batching=MicroBatching(rows=2))
    got, state = train_on_two_ray_ranks(tiny_model_dir, 1, marked(batch), loss_fn, 2)
    assert_same_step(got, state, want, single)
    # the means are over the trained rows, as one process that skips them computes them: the inert row
    # rank 1 takes back counts in neither their sums nor their counts
    skipping = make_worker(tiny_model_dir).train(
        marked(batch), loss_fn, global_batch_size=8, micro_batching=MicroBatching(rows=2)
    )
    for key in ("ratio", "clip_fraction"):
        assert got[key] == pytest.approx(skipping[key], rel=1e-5, abs=1e-7), key
