"""On a GPU: bfloat16 compute over float32 master weights, in one process (autocast) and under FSDP2 (mixed
precision policy); one AdamW update at lr 1e-6 equals AdamW in float64 on the same gradients."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from rlfleet.models.loading import ModelSource
from rlfleet.policy.rank import PolicyRank
from rlfleet.policy.sharded_rank import ShardedPolicyRank
from tests.functional.test_mixed_precision import SETTINGS, assert_float64_adamw_update

pytestmark = pytest.mark.gpu
LR = 1e-6


def test_one_process_bf16_update_on_cuda_equals_float64_adamw(tiny_model_dir: Path) -> None:
    source = ModelSource(str(tiny_model_dir), "bfloat16")
    cuda = torch.device("cuda", torch.cuda.current_device())
    worker = PolicyRank(source, dataclasses.replace(SETTINGS, lr=LR), keep_reference=True, device=cuda)
    assert {(p.device.type, p.dtype) for p in worker.model.parameters()} == {("cuda", torch.float32)}
    assert worker.reference is not None
    assert {p.dtype for p in worker.reference.parameters()} == {torch.bfloat16}
    assert worker.autocast_dtype == torch.bfloat16
    assert_float64_adamw_update(worker, LR)


def test_fsdp2_bf16_update_on_cuda_equals_float64_adamw(world_of_one: None, tiny_model_dir: Path) -> None:
    source = ModelSource(str(tiny_model_dir), "bfloat16")
    worker = ShardedPolicyRank(source, dataclasses.replace(SETTINGS, lr=LR), keep_reference=True)
    assert worker.device.type == "cuda" and worker.autocast_dtype is None  # FSDP2 casts to bfloat16
    assert_float64_adamw_update(worker, LR)
