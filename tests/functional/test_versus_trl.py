"""Smoke test of benchmarks/versus_trl.py: both frameworks run the tiny case, like for like and each at its
best, and the table with the FLOP floors, both speed-ups and each phase against its own floors prints; its
arguments; the overlong penalty TRL gets.

Needs TRL: the ``bench`` extra, which ``dev`` includes (``make test`` installs it), so it never skips.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "versus_trl.py"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_quick_comparison_prints_both_frameworks_and_the_speed_up() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick"], capture_output=True, text=True, timeout=230, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {line.split("|")[1].strip() for line in done.stdout.splitlines() if line.startswith("| ")}
    assert {"rlfleet float32", "rlfleet best", "TRL float32", "TRL bf16"} <= rows
    assert "speed-up rlfleet / TRL, like for like (float32):" in done.stdout
    assert "speed-up rlfleet / TRL, best against best:" in done.stdout
    assert "FLOP floor s" in done.stdout
    header = next(line for line in done.stdout.splitlines() if line.startswith("| | s/step"))
    assert [c.strip() for c in header.split("|")[4:9]] == [
        "generation",
        "reward",
        "logprobs",
        "training",
        "refit",
    ]
    cells = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith("| ")]
    by_phase = {(c[0].strip(), c[1].strip()): c for c in cells if len(c) == 7}
    for name in ("rlfleet best", "TRL bf16"):
        for phase in ("generation", "training"):
            assert (name, phase) in by_phase, f"no {phase} row for {name} in the by-phase table"
        assert by_phase[name, "generation"][5].strip(), "decoding's weight-read floor is missing"


def test_quick_is_the_smallest_case_and_the_defaults_are_the_benchmarks() -> None:
    from benchmarks.versus_trl import parse_args

    quick = parse_args(["--quick"])
    assert (quick.prompts, quick.samples, quick.max_new_tokens, quick.steps) == (2, 2, 8, 2)
    full = parse_args(["--steps", "6", "--override", "a=1", "--override", "b=2"])
    assert (full.prompts, full.samples, full.max_new_tokens, full.steps) == (4, 4, 64, 6)
    assert full.override == ["a=1", "b=2"] and not full.quick and not full.skip_trl
    assert not full.trl_compile and parse_args(["--trl-compile"]).trl_compile
    assert parse_args([]).steps == 4


def test_trl_gets_the_same_overlong_penalty_as_rlfleet() -> None:
    """time_to_accuracy.py gives TRL the recipe's overlong penalty as a second reward function (TRL sums
    them): for every length it is rlfleet's own penalty, and the SmolLM2 recipe's shaping is what it reads."""
    sys.path.insert(0, str(SCRIPT.parents[1]))
    from benchmarks.versus_trl import overlong_reward_for_trl

    from rlfleet.algorithms.grpo.loop import overlong_shaping
    from rlfleet.algorithms.overlong import overlong_penalty
    from rlfleet.config import load_recipe, resolve_recipe_path

    cfg = load_recipe(resolve_recipe_path("grpo-smollm2-135m-arithmetic-cpu"), [])
    shaping = overlong_shaping(cfg)
    assert shaping is not None and (shaping.max_response_length, shaping.buffer_length) == (160, 64)
    lengths = [5, 96, 97, 128, 160, 200]
    got = overlong_reward_for_trl(shaping)(completion_ids=[[1] * n for n in lengths], prompts=[], gold=[])
    expected = overlong_penalty(torch.tensor(lengths), 160, 64, 0.5).tolist()
    assert got == expected and got[:2] == [0.0, 0.0] and got[3] == -0.25 and got[4] == -0.5
    off = load_recipe(resolve_recipe_path("grpo-tiny-arithmetic-cpu"), [])
    assert overlong_shaping(off) is None
