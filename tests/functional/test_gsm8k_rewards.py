"""The math reward on the whole GSM8k test set: every way a model writes the right answer scores 1.0, a wrong
number scores 0.0, for every row, scored through a :class:`VerifierPool` as the trainer does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlfleet.rewards import VerifierPool, extract_gold, math_reward

GSM8K_TEST = (Path(__file__).parents[2] / ".." / "shared" / "data" / "gsm8k" / "test.jsonl").resolve()
NUM_ROWS = 1319


@pytest.fixture(scope="module")
def rows() -> list[dict[str, str]]:
    if not GSM8K_TEST.is_file():
        pytest.fail(
            f"the GSM8k test set is missing: expected {GSM8K_TEST} (1,319 JSON lines with 'question' and "
            "'answer'); CI always provides it, so put the shared data checkout next to the repository"
        )
    with GSM8K_TEST.open() as handle:
        records = [json.loads(line) for line in handle if line.strip()]
    assert len(records) == NUM_ROWS, f"{GSM8K_TEST} has {len(records)} rows, expected {NUM_ROWS}"
    return records


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
        expected = row["answer"].rpartition("####")[2].strip().replace(",", "")
        assert extract_gold(row["answer"]) == expected, f"row {index}: {row['answer'][-80:]!r}"


def test_every_gsm8k_row_scores_right_and_wrong_answers(rows):
    items, labels = [], []
    for index, row in enumerate(rows):
        gold = extract_gold(row["answer"])
        assert gold is not None, f"row {index} has no gold"
        worked = row["answer"].rpartition("####")[0].strip()
        for right, answer in ((True, gold), (False, str(int(gold) + 1))):
            for style, response in responses(worked, answer).items():
                items.append((row["question"], response, gold))
                labels.append((index, style, right))
    with VerifierPool(math_reward, num_workers=2, timeout_s=5.0) as pool:
        batch = pool.score(items)
    assert batch.num_timeouts == 0 and batch.num_errors == 0, batch
    failures = [
        f"row {index} ({style}, {'right' if right else 'wrong'} answer): reward {reward} for "
        f"...{item[1][-60:]!r}, gold {item[2]!r}"
        for (index, style, right), reward, item in zip(labels, batch.rewards, items, strict=True)
        if reward != float(right)
    ]
    assert not failures, f"{len(failures)} of {len(items)} misscored:\n" + "\n".join(failures[:20])
    assert sum(batch.rewards) == 5 * NUM_ROWS
