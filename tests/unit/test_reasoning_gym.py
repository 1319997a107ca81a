"""reasoning-gym as a data source and environment: rows generated offline from a seed, held-out validation
items, and replies scored by each task's own verifier."""

from __future__ import annotations

import pytest

from rlfleet.config import MasterConfig
from rlfleet.data import DataError, load_task
from rlfleet.environments.builtin import ReasoningGymEnvironment, reply_answer
from rlfleet.environments.interface import split_return


def data(**reasoning_gym: object) -> MasterConfig:
    return MasterConfig.model_validate(
        {"data": {"dataset_name": "reasoning_gym", "reasoning_gym": reasoning_gym}, "env": {}}
    )


def test_rows_are_generated_round_robin_with_held_out_validation() -> None:
    cfg = data(tasks=["basic_arithmetic", "chain_sum"], train_size=40, val_size=10, seed=3)
    train, val = load_task(cfg.data)
    assert len(val) == 10 and 0 < len(train) <= 40
    assert not {ex.question for ex in train} & {ex.question for ex in val}
    tasks = [ex.extra["rg_entry"]["metadata"]["source_dataset"] for ex in val if ex.extra]
    assert tasks[:4] == ["basic_arithmetic", "chain_sum", "basic_arithmetic", "chain_sum"]
    assert all(ex.env == "reasoning_gym" and ex.answer == f"<answer>{ex.gold}</answer>" for ex in train)
    again, _ = load_task(cfg.data)
    assert [ex.question for ex in again] == [ex.question for ex in train]  # the seed decides every item


def test_unknown_tasks_and_bad_settings_are_data_errors() -> None:
    with pytest.raises(DataError, match=r"did you mean basic_arithmetic"):
        load_task(data(tasks=["basic_arithmetc"]).data)
    with pytest.raises(DataError, match=r"not in data\.reasoning_gym\.tasks"):
        load_task(data(tasks=["chain_sum"], task_config={"basic_arithmetic": {}}).data)
    with pytest.raises(DataError, match="cannot be generated"):
        load_task(data(tasks=["chain_sum"], task_config={"chain_sum": {"min_terms": 5, "max_terms": 2}}).data)


@pytest.mark.parametrize(
    ("reply", "answer"),
    [
        ("First 2+3=5. <answer>5</answer>", "5"),
        ("<answer>1</answer> no wait <answer> 7 </answer>", "7"),
        ("so the total is 12.\n#### 12", "12"),
        ("The result: 41", "41"),
        ("So -(2 / 1) = -2.", "-2"),
        ("the total is 1,012.", "1012"),
        ("no digits here\nfinal: yes", "final: yes"),
        ("", ""),
    ],
)
def test_the_answer_of_a_reply(reply: str, answer: str) -> None:
    assert reply_answer(reply) == answer


def test_the_tasks_own_verifier_scores_the_reply() -> None:
    train, _ = load_task(data(tasks=["basic_arithmetic"], train_size=4, val_size=2).data)
    env = ReasoningGymEnvironment()
    row = train[0]
    logs = [
        [{"role": "user", "content": row.question}, {"role": "assistant", "content": reply}]
        for reply in (f"<answer>{row.gold}</answer>", "<answer>99999</answer>", "I do not know")
    ]
    outcomes = split_return(env.step(logs, [dict(row.extra or {})] * 3), 3)
    assert [o.reward for o in outcomes] == [1.0, 0.0, 0.0]
    assert all(o.terminated for o in outcomes) and outcomes[0].answer == row.gold
    with pytest.raises(ValueError, match="carries its entry"):
        env.step(logs[:1], [{"ground_truth": "5"}])
