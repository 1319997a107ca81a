"""Both policies implement the one ``Policy`` interface the loops are typed against, call for call."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest

from rlfleet.models.tiny import TinyModelSpec, build_tiny_model, train_tokenizer
from rlfleet.policy.interface import Policy
from rlfleet.policy.worker import OptimizerSettings, PolicyWorker

SETTINGS = OptimizerSettings(
    lr=1e-3,
    weight_decay=0.0,
    betas=(0.9, 0.999),
    eps=1e-8,
    warmup_steps=0,
    warmup_start_factor=1.0,
    max_grad_norm=1.0,
)
SPEC = TinyModelSpec(hidden_size=16, intermediate_size=32, num_hidden_layers=1, vocab_size=300)


def _policies() -> dict[str, object]:
    """One of each, built without a download or a Ray cluster."""
    from rlfleet.distributed.ray_policy import RayPolicy  # the ray extra (installed in dev)

    tokenizer = train_tokenizer(["one two three"], 300)
    model = build_tiny_model(SPEC, tokenizer, seed=0)
    worker = PolicyWorker(model, tokenizer, SETTINGS, keep_reference=False)
    on_ray = RayPolicy(SimpleNamespace(), tokenizer, keep_reference=True)  # a runtime is never called here
    return {"PolicyWorker": worker, "RayPolicy": on_ray}


POLICY_METHODS = [
    name
    for name, member in inspect.getmembers(Policy)
    if inspect.isfunction(member) and not name.startswith("_")
]
POLICY_ATTRIBUTES = [name for name, member in inspect.getmembers(Policy) if isinstance(member, property)]


def test_the_interface_lists_what_the_loops_call() -> None:
    assert set(POLICY_METHODS) == {
        "logprobs", "train", "take_metrics", "save", "load", "load_weights", "close"
    }  # fmt: skip
    assert set(POLICY_ATTRIBUTES) == {"tokenizer", "has_reference"}


@pytest.mark.parametrize("kind", ["PolicyWorker", "RayPolicy"])
def test_both_policies_implement_the_interface(kind: str) -> None:
    policy = _policies()[kind]
    assert isinstance(policy, Policy)
    for name in POLICY_ATTRIBUTES:
        assert getattr(policy, name) is not None, name
    for name in POLICY_METHODS:
        wanted = inspect.signature(getattr(Policy, name))
        got = inspect.signature(getattr(type(policy), name))
        shape = [(p.name, p.kind, p.default) for p in wanted.parameters.values()]
        assert [(p.name, p.kind, p.default) for p in got.parameters.values()] == shape, f"{kind}.{name}"
