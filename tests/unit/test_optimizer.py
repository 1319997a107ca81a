"""AdamW's implementation (``policy.optimizer.kwargs.foreach`` / ``fused``): which one runs, and that the
fused kernel the CPU default picks makes the same update as torch's other two."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rlfleet.config import MasterConfig
from rlfleet.policy.rank import adamw_implementation
from rlfleet.runtime.components import optimizer_settings
from tests.conftest import TEST_OPTIMIZER


@pytest.mark.parametrize(
    ("foreach", "fused", "device", "expected"),
    [
        (None, None, "cpu", (None, True)),  # the default: fused where torch has the kernel
        (None, None, "cuda", (None, True)),
        (None, None, "mps", (None, False)),  # no fused float32 AdamW kernel there: torch's choice
        (True, None, "cpu", (True, False)),  # asking for the multi-tensor one turns the default off
        (False, None, "cpu", (False, True)),
        (None, False, "cpu", (None, False)),  # NeMo RL's recipes say fused: false
        (False, False, "cuda", (False, False)),  # ... and foreach: false: the per-parameter loop
        (None, True, "cpu", (None, True)),
    ],
)
def test_adamw_implementation(
    foreach: bool | None, fused: bool | None, device: str, expected: tuple[bool | None, bool]
) -> None:
    settings = dataclasses.replace(TEST_OPTIMIZER, foreach=foreach, fused=fused)
    assert adamw_implementation(settings, device) == expected


def test_recipe_keys_reach_the_settings_and_both_true_is_refused() -> None:
    cfg = MasterConfig.model_validate(
        {"policy": {"optimizer": {"kwargs": {"foreach": False, "fused": False}}}}
    )
    settings = optimizer_settings(cfg)
    assert (settings.foreach, settings.fused) == (False, False)
    assert (optimizer_settings(MasterConfig()).foreach, optimizer_settings(MasterConfig()).fused) == (
        None,
        None,
    )
    with pytest.raises(ValueError, match="fused and foreach are two AdamW implementations"):
        MasterConfig.model_validate({"policy": {"optimizer": {"kwargs": {"foreach": True, "fused": True}}}})


def _run(implementation: dict[str, bool], steps: int = 5) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in ((7, 5), (5,), (3, 4, 2))]
    optimizer = torch.optim.AdamW(
        params, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-6, **implementation
    )
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        optimizer.step()
    return [p.detach() for p in params]


def test_fused_foreach_and_per_parameter_adamw_make_the_same_update() -> None:
    loop = _run({"foreach": False, "fused": False})
    start = _run({"foreach": False, "fused": False}, steps=0)
    for implementation in ({"foreach": True, "fused": False}, {"fused": True}):
        for got, want, initial in zip(_run(implementation), loop, start, strict=True):
            assert not torch.equal(got, initial)  # the steps moved the weights
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
