"""Both policies implement the one ``Policy`` interface the loops are typed against, call for call."""

from __future__ import annotations

import inspect
from pathlib import Path
from types import SimpleNamespace

import pytest

from rlfleet.models.loading import ModelSource
from rlfleet.policy.interface import Policy
from rlfleet.policy.rank import PolicyRank
from tests.conftest import TEST_OPTIMIZER as SETTINGS


def _policies(model_dir: Path) -> dict[str, object]:
    """One of each, built without a download or a Ray cluster."""
    from rlfleet.distributed.ray_policy import RayPolicy  # the ray extra (installed in dev)

    worker = PolicyRank(ModelSource(str(model_dir)), SETTINGS, keep_reference=False)
    # a runtime is never called here
    on_ray = RayPolicy(SimpleNamespace(), worker.tokenizer, keep_reference=True)
    return {"PolicyRank": worker, "RayPolicy": on_ray}


POLICY_METHODS = [
    name
    for name, member in inspect.getmembers(Policy)
    if inspect.isfunction(member) and not name.startswith("_")
]
POLICY_ATTRIBUTES = [name for name, member in inspect.getmembers(Policy) if isinstance(member, property)]


def test_the_interface_lists_what_the_loops_call() -> None:
    assert set(POLICY_METHODS) == {
        "accelerator_name", "logprobs", "train", "take_metrics", "save", "load", "load_weights", "close"
    }  # fmt: skip
    assert set(POLICY_ATTRIBUTES) == {"tokenizer", "has_reference"}


@pytest.mark.parametrize("kind", ["PolicyRank", "RayPolicy"])
def test_both_policies_implement_the_interface(kind: str, tiny_model_dir: Path) -> None:
    policy = _policies(tiny_model_dir)[kind]
    assert isinstance(policy, Policy)
    for name in POLICY_ATTRIBUTES:
        assert getattr(policy, name) is not None, name
    for name in POLICY_METHODS:
        wanted = inspect.signature(getattr(Policy, name))
        got = inspect.signature(getattr(type(policy), name))
        shape = [(p.name, p.kind, p.default) for p in wanted.parameters.values()]
        assert [(p.name, p.kind, p.default) for p in got.parameters.values()] == shape, f"{kind}.{name}"
