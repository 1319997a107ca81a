"""``benchmarks/agents.py``: its arguments, and its throughput part on the tiny model (many concurrent
OpenAI clients against the endpoint, and the same prompts straight to the backend). Its training part runs two
shipped recipes end to end (the agent's is tested token for token in test_agents.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from benchmarks import agents


def test_arguments_default_to_the_shipped_comparison() -> None:
    args = agents.parse_args([])
    assert (args.steps, args.agents, args.tokens, args.quick, args.skip_training) == (
        20,
        64,
        32,
        False,
        False,
    )
    assert agents.parse_args(["--quick", "--skip-training"]).skip_training
    with pytest.raises(SystemExit):
        agents.parse_args(["--steps", "x"])


def test_concurrent_agents_are_served_and_counted(tiny_model_dir: Path) -> None:
    served, direct = agents.throughput(tiny_model_dir, agents=6, tokens=4)
    assert served > 0 and direct > 0
