"""The math reward on the whole GSM8k test set (``tests/data/gsm8k``): every way a model writes the right
answer scores 1.0 and a wrong number 0.0, for every row, with the row's whole worked solution as the gold
(reduced to its ``#### N``), in process and through a :class:`ProcessWorkerPool` as the trainer scores."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from rlfleet.pools import ProcessWorkerPool
from rlfleet.rewards import extract_gold, math_reward

math_module = importlib.import_module("rlfleet.rewards.math")

GSM8K_TEST = Path(__file__).resolve().parents[1] / "data" / "gsm8k" / "test.jsonl"
NUM_ROWS = 1319


@pytest.fixture(scope="module")
def rows() -> list[dict[str, str]]:
    with GSM8K_TEST.open(encoding="utf-8") as handle:
        records = [json.loads(line) for line in handle if line.strip()]
    assert len(records) == NUM_ROWS, f"{GSM8K_TEST} has {len(records)} rows, expected {NUM_ROWS}"
    return records


def answer_of(row: dict[str, str]) -> str:
    """The row's final answer, read independently of the code under test."""
    return row["answer"].rpartition("####")[2].strip().replace(",", "")


def responses(worked: str, answer: str) -> dict[str, str]:
    """The final answer ``answer`` written the ways a model writes it, after the worked solution."""
    return {
        "####": f"{worked}\n#### {answer}",
        "boxed": f"{worked} so the answer is \\boxed{{{answer}}}.",
        "the answer is": f"{worked}\nThe answer is {answer}.",
        "currency": f"{worked}\n${int(answer):,}",
        "plain": f"{worked}\n{answer}",
    }


def test_gold_is_the_number_after_the_hashes(rows):
    for index, row in enumerate(rows):
        assert extract_gold(row["answer"]) == answer_of(row), f"row {index}: {row['answer'][-80:]!r}"


def test_worked_solution_as_gold_in_process(rows, monkeypatch):
    symbolic: list[tuple[str, str]] = []  # checks that went to math-verify instead of the exact fast path

    def no_symbolic_match(expression: str, gold: str) -> bool:
        symbolic.append((expression, gold))
        return False

    monkeypatch.setattr(math_module, "symbolic_match", no_symbolic_match)
    for index, row in enumerate(rows):
        worked, answer = row["answer"].rpartition("####")[0].strip(), answer_of(row)
        right = math_reward(row["question"], f"{worked}\n#### {answer}", row["answer"])
        wrong = math_reward(row["question"], f"{worked}\n#### {int(answer) + 1}", row["answer"])
        assert (right, wrong) == (1.0, 0.0), f"row {index}: gold {row['answer'][-40:]!r}"
    assert not symbolic, f"{len(symbolic)} plain-number checks took math-verify's path, e.g. {symbolic[:3]}"


def test_every_gsm8k_row_scores_right_and_wrong_answers_in_the_pool(rows):
    items, labels = [], []
    for index, row in enumerate(rows):
        worked, answer = row["answer"].rpartition("####")[0].strip(), answer_of(row)
        for right, given in ((True, answer), (False, str(int(answer) + 1))):
            for style, response in responses(worked, given).items():
                items.append((row["question"], response, row["answer"]))  # the whole solution as the gold
                labels.append((index, style, right))
    with ProcessWorkerPool(math_reward, num_workers=2, timeout_s=5.0) as pool:
        batch = pool.score(items)
    assert batch.num_timeouts == 0 and batch.num_errors == 0, batch
    failures = [
        f"row {index} ({style}, {'right' if right else 'wrong'} answer): reward {reward} for "
        f"...{item[1][-60:]!r}, gold ...{item[2][-30:]!r}"
        for (index, style, right), reward, item in zip(labels, batch.rewards, items, strict=True)
        if reward != float(right)
    ]
    assert not failures, f"{len(failures)} of {len(items)} misscored:\n" + "\n".join(failures[:20])
    assert sum(batch.rewards) == 5 * NUM_ROWS
