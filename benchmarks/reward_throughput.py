"""Verification throughput: :class:`ProcessWorkerPool` with 1, 2 and 4 workers vs in-process scoring.

Builds about 2,000 GSM8k-style responses from the GSM8k test set in ``tests/data`` (``#### N``,
``\\boxed{N}``, "The answer is N.", ``$1,080``, a LaTeX fraction equal to N, and wrong answers), scores them
in batches of a GRPO step's size and prints responses per second, as a ratio against in-process
``math_reward`` on one core. A row for "math-verify on the whole response" shows what the plain-number fast
path saves.

    .venv/bin/python benchmarks/reward_throughput.py [--rows 400] [--batch 256] [--workers 1 2 4]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from math_verify import parse, verify

from rlfleet.pools import ProcessWorkerPool
from rlfleet.rewards import extract_gold, math_reward

Item = tuple[str, str, str]
DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "gsm8k" / "test.jsonl"  # 1,319 rows


def build_items(first: int, rows: int) -> list[Item]:
    """Five responses per GSM8k row from row ``first`` on (four right in different formats, one wrong),
    plus a LaTeX fraction for every fourth row."""
    items: list[Item] = []
    with DATA.open() as handle:
        records = [json.loads(line) for line in handle][first : first + rows]
    for index, record in enumerate(records):
        gold = extract_gold(record["answer"])
        assert gold is not None, record
        body = record["answer"].rpartition("####")[0].strip()
        n = int(gold)
        question = record["question"]
        items += [
            (question, f"{body}\n#### {gold}", gold),
            (question, f"{body}\nSo the answer is \\boxed{{{gold}}}.", gold),
            (question, f"{body}\nThe answer is {gold}.", gold),
            (question, f"{body}\nShe pays ${n:,}", gold),
            (question, f"{body}\nThe answer is {n + 1}.", gold),
        ]
        if index % 4 == 0:
            items.append((question, f"{body}\nSo the answer is $\\frac{{{2 * n}}}{{2}}$.", gold))
    return items


def whole_response_math_verify(prompt: str, response: str, gold: str) -> float:
    """math-verify alone on the whole response (no extraction of our own), for comparison."""
    del prompt
    return float(verify(parse(f"${gold}$"), parse(response)))


def time_in_process(fn: Callable[[str, str, str], float], items: Sequence[Item]) -> tuple[float, float]:
    start = time.perf_counter()
    rewards = [fn(*item) for item in items]
    return time.perf_counter() - start, sum(rewards)


def time_pool(
    workers: int, items: Sequence[Item], warm_up: Sequence[Item], batch: int
) -> tuple[float, float, float]:
    start = time.perf_counter()
    with ProcessWorkerPool("rlfleet.rewards.math_reward", num_workers=workers, timeout_s=5.0) as pool:
        pool.wait_ready()
        startup = time.perf_counter() - start
        pool.score(warm_up)
        start = time.perf_counter()
        total = sum(sum(pool.score(items[i : i + batch]).rewards) for i in range(0, len(items), batch))
        return time.perf_counter() - start, total, startup


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=400, help="GSM8k rows (about 5.25 responses each)")
    parser.add_argument("--batch", type=int, default=256, help="responses per score() call (a GRPO step)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    items = build_items(0, args.rows)
    # Warm-up on other rows: math-verify's first call is slow, and it caches parses of repeated strings.
    warm_up = build_items(args.rows, 60)
    time_in_process(math_reward, warm_up)
    base_s, base_total = time_in_process(math_reward, items)
    rows = [("in-process math_reward", base_s, base_total, 0.0)]
    time_in_process(whole_response_math_verify, warm_up)
    mv_s, mv_total = time_in_process(whole_response_math_verify, items)
    rows.append(("in-process math-verify only", mv_s, mv_total, 0.0))
    for workers in args.workers:
        seconds, total, startup = time_pool(workers, items, warm_up, args.batch)
        rows.append((f"ProcessWorkerPool num_workers={workers}", seconds, total, startup))
    print(f"{len(items)} responses, batches of {args.batch}, expected correct {base_total:.0f}")
    print(f"{'mode':<34}{'responses/s':>12}{'ratio':>8}{'correct':>9}{'start-up s':>12}")
    for name, seconds, total, startup in rows:
        rate = len(items) / seconds
        print(f"{name:<34}{rate:>12.0f}{base_s / seconds:>8.2f}{total:>9.0f}{startup:>12.2f}")


if __name__ == "__main__":
    main()
