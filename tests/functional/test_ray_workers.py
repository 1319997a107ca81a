"""Ray placement groups, a gloo worker group, and FSDP2 data-parallel training equal to one process."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest
import ray
import torch
import torch.distributed as dist

from rlfleet.distributed.cluster import (
    ClusterCapacityError,
    create_node_placement_groups,
    remove_placement_groups,
)
from rlfleet.distributed.rank_group import RankDiedError, RayRankGroup
from rlfleet.models.loading import ModelSource
from rlfleet.policy.rank import PolicyRank
from rlfleet.policy.sharded_rank import ShardedPolicyRank
from tests.conftest import TEST_OPTIMIZER, pg_loss, worker_batch

TIMEOUT_S = 120.0


class RankProbe:
    """A minimal per-rank worker: all-reduces its rank id."""

    def all_reduce_rank(self) -> float:
        value = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(value)
        return float(value)

    def backend(self) -> str:
        return str(dist.get_backend())


@pytest.mark.timeout(120)  # a hang guard: the wait must end at the placement timeout, not block
def test_impossible_layout_fails_fast_with_request_and_resources(ray_cluster: None) -> None:
    with pytest.raises(ClusterCapacityError) as info:
        create_node_placement_groups(num_nodes=1, bundles_per_node=64, use_gpus=False, timeout_s=5.0)
    message = str(info.value)
    assert message.startswith("placement groups not ready after 5s")  # the timeout given ended the wait
    assert "1 node(s) x 64 bundle(s)" in message and "'CPU': 1.0" in message
    assert "'CPU': 4.0" in message  # the cluster's resources
    # what it reserved was released: a feasible layout still fits
    groups = create_node_placement_groups(num_nodes=1, bundles_per_node=4, use_gpus=False, timeout_s=30.0)
    remove_placement_groups(groups)


def test_two_ranks_form_a_gloo_process_group(ray_cluster: None) -> None:
    groups = create_node_placement_groups(num_nodes=1, bundles_per_node=2, use_gpus=False, timeout_s=30.0)
    group = RayRankGroup(RankProbe, groups, {}, timeout_s=TIMEOUT_S)
    try:
        assert group.run_all("all_reduce_rank") == [1.0, 1.0]
        assert group.run_all("backend") == ["gloo", "gloo"]
        ray.kill(group.actors[1], no_restart=True)
        # ray.kill is asynchronous: a call may still reach the actor before it dies. Within a bounded
        # time every call must fail with the rank named.
        deadline = time.monotonic() + 30
        with pytest.raises(RankDiedError, match="rank 1 died"):
            while time.monotonic() < deadline:
                group.run_all("backend")
                time.sleep(0.2)
    finally:
        group.shutdown()
        remove_placement_groups(groups)


SETTINGS = dataclasses.replace(TEST_OPTIMIZER, weight_decay=0.01, eps=1e-6)
LOSS = pg_loss(kl_penalty=0.05)


def test_two_rank_fsdp_step_equals_single_process_step(ray_cluster: None, tiny_model_dir: Path) -> None:
    path = str(tiny_model_dir)
    single = PolicyRank(ModelSource(path), SETTINGS, keep_reference=False)
    batch = worker_batch(single, noise=0.05)
    expected_lp = single.logprobs(batch, micro_batching=2)
    initial = {name: value.clone() for name, value in single.model.state_dict().items()}
    expected = single.train(batch, LOSS, global_batch_size=4, micro_batching=1)
    groups = create_node_placement_groups(num_nodes=1, bundles_per_node=2, use_gpus=False, timeout_s=30.0)
    init = {"source": ModelSource(str(tiny_model_dir)), "settings": SETTINGS}
    group = RayRankGroup(ShardedPolicyRank, groups, init, timeout_s=TIMEOUT_S)
    try:
        lps = group.run_all("logprobs", batch, 2)
        metrics = group.run_all("train", batch, LOSS, global_batch_size=4, micro_batching=1)
        state = group.run_all("full_state_dict")[0]
    finally:
        group.shutdown()
        remove_placement_groups(groups)
    torch.testing.assert_close(lps[0], expected_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lps[1], expected_lp, atol=1e-5, rtol=1e-5)
    assert metrics[0] == pytest.approx(metrics[1])
    for key in ("loss", "kl", "ratio", "clip_fraction", "grad_norm", "lr"):
        assert metrics[0][key] == pytest.approx(expected[key], rel=1e-4, abs=1e-6), key
    reference = single.model.state_dict()
    assert set(state) == set(reference)
    moved = max(float((reference[name] - initial[name]).abs().max()) for name in reference)
    assert moved > 1e-4  # the step changed the weights by far more than the tolerance
    for name, value in reference.items():
        torch.testing.assert_close(state[name], value, atol=1e-5, rtol=1e-4, msg=name)


def test_sharded_checkpoint_round_trip(ray_cluster: None, tiny_model_dir: Path, tmp_path: Path) -> None:
    path = str(tiny_model_dir)
    batch = worker_batch(PolicyRank(ModelSource(path), SETTINGS, keep_reference=False), noise=0.05)
    groups = create_node_placement_groups(num_nodes=1, bundles_per_node=2, use_gpus=False, timeout_s=30.0)
    init = {"source": ModelSource(path), "settings": SETTINGS}
    group = RayRankGroup(ShardedPolicyRank, groups, init, TIMEOUT_S)
    try:
        group.run_all("train", batch, LOSS, global_batch_size=4, micro_batching=2)
        saved = group.run_all("full_state_dict")[0]
        group.run_all("save", tmp_path / "step_1")
        group.run_all("train", batch, LOSS, global_batch_size=4, micro_batching=2)
        group.run_all("load", tmp_path / "step_1")
        restored = group.run_all("full_state_dict")[0]
        after = group.run_all("train", batch, LOSS, global_batch_size=4, micro_batching=2)
    finally:
        group.shutdown()
        remove_placement_groups(groups)
    assert (tmp_path / "step_1" / "policy" / "weights" / ".metadata").is_file()
    for name, value in saved.items():
        torch.testing.assert_close(restored[name], value, msg=name)
    assert after[0]["loss"] == after[1]["loss"]
