"""The demo's closing line: the accuracy before SFT, after SFT and after GRPO, each from the validation that
measured it."""

from __future__ import annotations

import pytest

from rlfleet.demo import accuracy_line, stage_accuracies


@pytest.mark.parametrize(
    ("sft", "grpo", "expected"),
    [
        # both stages validate at their start and their end (the recipes' defaults)
        ([(0, 0.005), (300, 0.045)], [(0, 0.045), (8, 0.04), (16, 0.035)], (0.005, 0.045, 0.035)),
        # GRPO without a validation at its start: after SFT is the SFT stage's last (the same model)
        ([(3, 0.01)], [(3, 0.02)], (None, 0.01, 0.02)),
        # GRPO never validated after a step
        ([(0, 0.0), (5, 0.1)], [(0, 0.1)], (0.0, 0.1, None)),
        ([], [], (None, None, None)),
    ],
)
def test_each_accuracy_comes_from_the_validation_that_measured_it(
    sft: list[tuple[int, float]], grpo: list[tuple[int, float]], expected: tuple[float | None, ...]
) -> None:
    assert stage_accuracies(sft, grpo) == expected


def test_the_line_names_what_was_measured() -> None:
    assert (
        accuracy_line(0.005, 0.045, 0.035)
        == "0.5% before SFT -> 4.5% after SFT -> 3.5% after GRPO (-1.0 points)"
    )
    # printed "2.0% after SFT -> 2.0% after GRPO" before: the GRPO stage had no step-0 validation
    assert accuracy_line(None, 0.01, 0.02) == "1.0% after SFT -> 2.0% after GRPO (+1.0 points)"
    assert accuracy_line(0.0, 0.1, None) == "0.0% before SFT -> 10.0% after SFT"
    assert accuracy_line(None, None, None).startswith("not validated")
