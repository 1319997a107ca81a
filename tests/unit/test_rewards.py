"""Answer extraction, the math reward (regex fast path + math-verify) and the verifier pool."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from rlfleet.answers import MAX_GOLD_CHARS
from rlfleet.pools import ProcessWorkerPool, RewardBatch
from rlfleet.rewards import (
    InvalidGoldError,
    extract_answer,
    extract_gold,
    gold_answer,
    load_reward_fn,
    math_reward,
)
from rlfleet.rewards.verify import time_budget

TIMEOUT_S = 1.0

# ------------------------------------------------------------------ reward functions run by pool workers
# Top level so that workers can import them (``tests.unit.test_rewards.<name>``).


def stall_reward(prompt: str, response: str, gold: str) -> float:
    """Like a check stuck in C code: SIGALRM is blocked, so only a kill ends it."""
    if response == "stall":
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        time.sleep(60)
    return 1.0


def slow_reward(prompt: str, response: str, gold: str) -> float:
    time.sleep(0.05)
    return 1.0


def die_once_reward(prompt: str, response: str, gold: str) -> float:
    """Kills its own process the first time it sees ``die`` (the marker file ``prompt`` remembers)."""
    if response == "die" and not Path(prompt).exists():
        Path(prompt).touch()
        os.kill(os.getpid(), signal.SIGKILL)
    return 1.0


def always_die_reward(prompt: str, response: str, gold: str) -> float:
    if response == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    return 1.0


def raising_reward(prompt: str, response: str, gold: str) -> float:
    if response == "raise":
        raise KeyError("boom")
    if response == "not a number":
        return "x"  # type: ignore[return-value]
    return 0.5


# ---------------------------------------------------------------------------------------- extraction


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("3 + 4 = 7\n#### 7", "7"),
        ("#### 1,080", "1080"),
        ("so the answer is \\boxed{42}.", "42"),
        ("I think 12 then 15", "15"),
        ("#### -3", "-3"),
        ("#### $18", "18"),
        ("#### 2.50", "2.50"),
        ("no numbers here", None),
        ("first #### 5 then #### 6", "6"),
        ("\\boxed{3} but #### 4", "4"),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    ("output", "expected"),
    [
        ("3 + 4 = <<3+4=7>>7\n#### 7", "7"),
        ("#### 1,080", "1080"),
        ("#### $18.", "18"),
        ("#### -10", "-10"),
        ("first #### 5\nthen #### 6\n", "6"),
        ("#### 3/4", "3/4"),
        ("#### B", "B"),
        ("so \\boxed{\\frac{1}{2}} and \\boxed{\\frac{3}{4}}", "\\frac{3}{4}"),
        ("\\boxed{5}\n####", "5"),
        ("\\boxed{5", None),
        ("\\boxed{ }", None),
        ("the answer is 5", None),
    ],
)
def test_extract_gold(output, expected):
    assert extract_gold(output) == expected


# --------------------------------------------------------------------------------------- math_reward


@pytest.mark.parametrize(
    ("response", "gold"),
    [
        ("4 + 4 = <<4+4=8>>8\n#### 8", "8"),
        ("#### 8.0", "8"),
        ("#### 1,080", "1080"),
        ("#### 1080", "1,080"),
        ("#### $1,080", "1080"),
        ("so the answer is \\boxed{72}.", "72"),
        ("so the answer is \\boxed{\\$1{,}080}.", "1080"),
        ("\\boxed{18 \\text{ dollars}}", "18"),
        ("The answer is 42.", "42"),
        ("She earns $1,080 in total.", "1080"),
        ("He pays $2,880,000", "2880000"),
        ("12 eggs, then 15", "15"),
        ("The discount is 20%.", "20"),
        ("The answer is **-3**", "-3"),
        ("\\boxed{\\frac{3}{4}}", "0.75"),
        ("\\boxed{0.75}", "\\frac{3}{4}"),
        ("The answer is 3/4", "0.75"),
        ("The answer is $\\frac{3}{4}$.", "3/4"),
        ("#### \\frac{3}{4}", "0.75"),
        ("\\boxed{2^{10}}", "1024"),
        ("The answer is 0.75", "\\frac{3}{4}"),
        ("\\boxed{\\sqrt{2}}", "\\sqrt{2}"),
    ],
)
def test_math_reward_right(response, gold):
    assert math_reward("p", response, gold) == 1.0


@pytest.mark.parametrize(
    ("response", "gold"),
    [
        ("#### 9", "8"),
        ("#### 1,081", "1080"),
        ("so the answer is \\boxed{73}.", "72"),
        ("The answer is 43.", "42"),
        ("She earns $1,079 in total.", "1080"),
        ("The answer is 3/4", "4"),  # the last number is part of a fraction
        ("\\boxed{\\frac{3}{5}}", "0.75"),
        ("\\boxed{2^{10}}", "10"),
        ("\\boxed{3} but #### 4", "3"),  # #### wins over \boxed
        ("nothing", "8"),
        ("", "8"),
        ("#### 8", "not a number"),  # a short one-line gold is an answer, just not this one
        ("\\boxed{\\sqrt{3}}", "\\sqrt{2}"),
    ],
)
def test_math_reward_wrong(response, gold):
    assert math_reward("p", response, gold) == 0.0


# ---------------------------------------------------------------------------------------- the gold

WORKED = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nShe sold 48+24 = <<48+24=72>>72 clips.\n#### 72"


@pytest.mark.parametrize(
    ("gold", "expected"),
    [
        ("72", "72"),
        ("  72\n", "72"),  # stripped
        ("1,080", "1,080"),  # an answer already: left as it is (the fast path drops the comma)
        ("\\frac{3}{4}", "\\frac{3}{4}"),
        ("B", "B"),
        ("not a number", "not a number"),  # one short line: an answer, compared by math-verify
        (WORKED, "72"),  # GSM8k's whole answer field
        ("work\n#### 1,080\n", "1080"),
        ("so \\boxed{\\frac{3}{4}}.", "\\frac{3}{4}"),
        ("work\nmore work\nso \\boxed{5}", "5"),
        ("x" * MAX_GOLD_CHARS, "x" * MAX_GOLD_CHARS),  # the longest answer
        ("#### " + "x" * MAX_GOLD_CHARS, "x" * MAX_GOLD_CHARS),
    ],
)
def test_gold_answer_keeps_or_reduces(gold, expected):
    assert gold_answer(gold) == expected


@pytest.mark.parametrize(
    ("gold", "message"),
    [
        ("", "is empty"),
        (" \n\t", "is empty"),
        ("x" * (MAX_GOLD_CHARS + 1), "is 101 characters long"),
        ("#### " + "x" * (MAX_GOLD_CHARS + 1), "reduced to"),
        ("She sold 24 clips in May.\nShe sold 72 clips in all.", "spans several lines"),
        ("She sold 24 clips in May,\r72 in all", "spans several lines"),
        (
            "Natalia sold 48/2 = 24 clips in May, and then 48 + 24 = 72 clips altogether in April and May, "
            "so 72 is the answer.",
            r"is 114 characters long \(at most 100\)",
        ),
        ("work\n####", "no answer after it"),
        ("work\n####  \n", "no answer after it"),
        ("so \\boxed{5", "no answer after it"),
        ("so \\boxed{ }", "no answer after it"),
        ("\\boxed{1\n2}", "spans several lines"),
    ],
)
def test_gold_that_is_no_answer_raises(gold, message):
    with pytest.raises(InvalidGoldError, match=message) as caught:
        gold_answer(gold)
    assert isinstance(caught.value, ValueError)
    assert "pass the final answer" in str(caught.value) or "pass the answer itself" in str(caught.value)
    with pytest.raises(InvalidGoldError):
        math_reward("p", "#### 72", gold)


def test_worked_solution_gold_is_scored_by_its_answer():
    assert math_reward("p", "so #### 72", WORKED) == 1.0
    assert math_reward("p", "so \\boxed{72}", WORKED) == 1.0
    assert math_reward("p", "so #### 24", WORKED) == 0.0  # a number of the rationale is not the answer
    assert math_reward("p", "She sold 72 clips.", WORKED) == 1.0  # the last number, with its unit
    assert math_reward("p", "She sold 24 clips in May.", WORKED) == 0.0


def test_bad_response_never_raises_with_a_good_gold():
    for response in ("", "####", "\\boxed{", "\\boxed{}", "#### \n", "x" * 20_000):
        assert math_reward("p", response, "72") == 0.0


def test_huge_response_is_bounded():
    assert math_reward("p", "x" * 2_000_000 + " #### 5", "5") == 1.0
    # only the last 10,000 characters are read: an answer before them is not seen
    assert math_reward("p", "#### 5\n" + "x" * 10_000, "5") == 0.0
    assert math_reward("p", "#### 5\n" + "x" * 9_000, "5") == 1.0


def test_math_reward_works_off_the_main_thread():
    # math-verify's own timeouts use signal.alarm, which raises off the main thread; ours stand down.
    with ThreadPoolExecutor(2) as threads:
        rewards = list(
            threads.map(lambda r: math_reward("p", r, "0.75"), ["\\boxed{\\frac{3}{4}}", "#### 1"])
        )
    assert rewards == [1.0, 0.0]


# name -> (response, gold, whether the check reaches sympy/ANTLR and runs out of time). The others are
# rejected in microseconds: only the last 10,000 characters are read, and an answer over 1,000 characters
# is never parsed.
HOSTILE = {
    "power tower": ("\\boxed{9^{9^{9^{9}}}}", "72", True),
    "power tower, no box": ("The answer is $9^{9^{9^{9}}}$.", "72", True),
    "power-tower gold": ("\\boxed{72}", "9^{9^{9^9}}", True),
    "20 nested braces": ("\\boxed{" + "{" * 20 + "1" + "}" * 20 + "}", "2", True),  # ANTLR: minutes
    "1 MB response": ("1+" * 500_000 + "1", "500001", False),
    "10,000 nested parentheses": ("\\boxed{" + "(" * 10_000 + "1" + ")" * 10_000 + "}", "1", False),
    "10,000 nested braces": ("\\boxed{" + "{" * 10_000 + "1" + "}" * 10_000 + "}", "1", False),
    "10,000 nested brackets, then ####": ("[" * 10_000 + "]" * 10_000 + " #### 1", "2", False),
    "600 nested braces": ("\\boxed{" + "{" * 600 + "1" + "}" * 600 + "}", "1", False),
}


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_input_in_process_is_bounded(name):
    # In process the bound is a SIGALRM, which cannot interrupt C code (a regex) until it returns, and a
    # host process's own timers and handlers can displace it; so it is checked in a fresh interpreter.
    # The hard bound in training is ProcessWorkerPool's kill-and-replace, tested below.
    # The budget is what bounds it: a check that reaches sympy/ANTLR is interrupted by it (the same check
    # under the same budget raises VerificationTimeout), the others are rejected before they need it.
    response, gold, times_out = HOSTILE[name]
    code = textwrap.dedent(
        """
        import sys
        from rlfleet.rewards import math_reward
        from rlfleet.rewards.math import answers_match
        from rlfleet.rewards.verify import VerificationTimeout, time_budget

        r, g = sys.stdin.read().split("\\0")
        value, budget = math_reward("p", r, g, timeout_s=0.5), "kept"
        try:
            with time_budget(0.5):
                answers_match(r, g)
        except VerificationTimeout:
            budget = "expired"
        print(value, budget)
        """
    )
    out = subprocess.run(  # the timeout is a hang guard (a check stuck in C code)
        [sys.executable, "-c", code], input=f"{response}\0{gold}", capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    value, budget = out.stdout.split()
    assert float(value) == 0.0
    assert budget == ("expired" if times_out else "kept")


def test_time_budget_nests_inside_a_foreign_timer_and_restores_it():
    fired = []
    previous = signal.signal(signal.SIGALRM, lambda *_: fired.append(True))
    try:
        signal.setitimer(signal.ITIMER_REAL, 2.0)
        with time_budget(0.1) as armed:
            assert armed
            with time_budget(0.05) as inner:
                assert not inner  # the outer budget owns the time
        remaining = signal.getitimer(signal.ITIMER_REAL)[0]
        assert 1.5 < remaining < 2.0
        with time_budget(5.0) as armed:
            assert not armed  # the foreign timer fires first anyway
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0.0)
        signal.signal(signal.SIGALRM, previous)
    assert not fired


def test_load_reward_fn():
    assert load_reward_fn("rlfleet.rewards.math_reward") is math_reward
    with pytest.raises(ValueError, match="cannot import"):
        load_reward_fn("rlfleet.rewards.nope")
    with pytest.raises(ValueError, match="dotted path"):
        load_reward_fn("nodots")


# -------------------------------------------------------------------------------------- ProcessWorkerPool


@pytest.fixture(scope="module")
def math_pool() -> Iterator[ProcessWorkerPool]:
    with ProcessWorkerPool("rlfleet.rewards.math_reward", num_workers=2, timeout_s=TIMEOUT_S) as pool:
        yield pool


def _normal_items() -> list[tuple[str, str, str]]:
    items = []
    for n in range(1, 41):
        gold = str(n * 37)
        items += [
            ("q", f"work\n#### {n * 37:,}", gold),
            ("q", f"so \\boxed{{{n * 37}}}.", gold),
            ("q", f"The answer is {n * 37 + 1}.", gold),
            ("q", f"The answer is $\\frac{{{2 * n * 37}}}{{2}}$.", gold),
            ("q", f"nothing to see {n}x", gold),
        ]
    return items


def test_pool_matches_in_process(math_pool):
    items = _normal_items()
    batch = math_pool.score(items)
    assert batch == RewardBatch([math_reward(*item) for item in items], 0, 0)
    assert sum(batch.rewards) == 120
    assert math_pool.score([]) == RewardBatch([], 0, 0)


@pytest.mark.timeout(120)  # a hang guard
@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_input_in_pool_is_bounded_and_counted(math_pool, name):
    response, gold, times_out = HOSTILE[name]
    math_pool.wait_ready()
    workers = math_pool.worker_pids
    batch = math_pool.score([("q", response, gold), ("q", "#### 5", "5")])
    assert batch == RewardBatch([0.0, 1.0], num_timeouts=int(times_out), num_errors=0)
    assert math_pool.worker_pids == workers  # the in-worker budget stopped it: no kill, no restart


@pytest.mark.timeout(120)  # a hang guard
def test_hostile_batch_in_pool(math_pool):
    items = [("q", response, gold) for response, gold, _ in HOSTILE.values()] + _normal_items()
    batch = math_pool.score(items)
    # each hostile item spent its own budget: exactly those timed out, and every normal item scored
    assert batch.rewards == [0.0] * len(HOSTILE) + [math_reward(*item) for item in _normal_items()]
    assert batch.num_timeouts == sum(times_out for _, _, times_out in HOSTILE.values())


@pytest.mark.timeout(120)  # a hang guard
def test_stuck_worker_is_killed_and_replaced():
    with ProcessWorkerPool(stall_reward, num_workers=2, timeout_s=TIMEOUT_S) as pool:
        pool.wait_ready()
        before = pool.worker_pids
        batch = pool.score([("q", "ok", "g"), ("q", "stall", "g"), *[("q", "ok", "g")] * 20])
        # the stall (60 s, SIGALRM blocked) counted as a timeout and its worker replaced: it was killed
        assert batch == RewardBatch([1.0, 0.0] + [1.0] * 20, num_timeouts=1, num_errors=0)
        assert len(set(pool.worker_pids) - set(before)) == 1
        assert pool.score([("q", "ok", "g")] * 4).rewards == [1.0] * 4


def test_reward_errors_are_counted_and_logged_once_per_type(caplog):
    caplog.set_level(logging.ERROR, logger="rlfleet.pools.process_pool")
    items = [("q", "raise", "g"), ("q", "fine", "g"), ("q", "not a number", "g"), ("q", "raise", "g")]
    with ProcessWorkerPool(raising_reward, num_workers=1, timeout_s=TIMEOUT_S) as pool:
        batch = pool.score(items)
        assert pool.score(items) == batch  # the second batch is counted again, not logged again
    assert batch == RewardBatch([0.0, 0.5, 0.0, 0.0], num_timeouts=0, num_errors=3)
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == 2, messages
    assert "raising_reward raised KeyError: 'boom'" in messages[0]
    assert "raised ValueError: could not convert string to float" in messages[1]


def test_invalid_gold_is_an_error_in_the_pool(caplog):
    caplog.set_level(logging.ERROR, logger="rlfleet.pools.process_pool")
    rationale = "She sold 24 clips in May.\nShe sold 72 clips in all."
    items = [("q", "#### 72", rationale), ("q", "#### 72", WORKED), ("q", "#### 7", ""), ("q", "#### 7", "7")]
    with ProcessWorkerPool("rlfleet.rewards.math_reward", num_workers=1, timeout_s=5.0) as pool:
        assert pool.score(items) == RewardBatch([0.0, 1.0, 0.0, 1.0], num_timeouts=0, num_errors=2)
    (record,) = caplog.records
    message = record.getMessage()
    assert "rlfleet.rewards.math_reward raised InvalidGoldError" in message
    assert "spans several lines" in message and "train/reward_errors" in message


def test_worker_killed_mid_batch_is_replaced_and_the_batch_completes():
    with ProcessWorkerPool(slow_reward, num_workers=2, timeout_s=5.0) as pool:
        pool.wait_ready()
        victim = pool.worker_pids[0]
        killer = threading.Timer(0.2, os.kill, (victim, signal.SIGKILL))  # like the OOM killer
        killer.start()
        batch = pool.score([("q", "r", "g")] * 24)  # ~0.6 s on 2 workers
        killer.join()
        assert batch == RewardBatch([1.0] * 24, 0, 0)
        assert victim not in pool.worker_pids


def test_item_that_kills_its_worker_is_retried_once(tmp_path):
    marker = str(tmp_path / "died")
    with ProcessWorkerPool("tests.unit.test_rewards.die_once_reward", num_workers=2, timeout_s=5.0) as pool:
        batch = pool.score([(marker, "ok", "g"), (marker, "die", "g"), *[(marker, "ok", "g")] * 10])
        assert batch == RewardBatch([1.0] * 12, 0, 0)
        assert Path(marker).exists()


def test_item_that_kills_every_worker_raises_and_the_pool_recovers():
    with ProcessWorkerPool(always_die_reward, num_workers=2, timeout_s=5.0) as pool:
        with pytest.raises(RuntimeError, match="died twice on item 1"):
            pool.score([("q", "ok", "g"), ("q", "die", "g"), ("q", "ok", "g")])
        assert pool.score([("q", "ok", "g")] * 3).rewards == [1.0] * 3


def test_pool_arguments_are_checked():
    with pytest.raises(ValueError, match="num_workers must be >= 1"):
        ProcessWorkerPool(math_reward, num_workers=0, timeout_s=1.0)
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        ProcessWorkerPool(math_reward, num_workers=1, timeout_s=0.0)
    with pytest.raises(ValueError, match="top-level function"):
        ProcessWorkerPool(lambda p, r, g: 1.0, num_workers=1, timeout_s=1.0)
    with pytest.raises(ValueError, match="cannot import"):
        ProcessWorkerPool("rlfleet.rewards.nope", num_workers=1, timeout_s=1.0)
    with pytest.raises(ValueError, match="start_method"):
        ProcessWorkerPool(math_reward, num_workers=1, timeout_s=1.0, start_method="fork")  # type: ignore[arg-type]


def test_closed_pool_refuses_work():
    pool = ProcessWorkerPool(math_reward, num_workers=1, timeout_s=1.0)
    assert pool.score([("q", "#### 1", "1")]).rewards == [1.0]
    pids = pool.worker_pids
    pool.close()
    pool.close()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # stopped and reaped
    with pytest.raises(RuntimeError, match="closed"):
        pool.score([("q", "#### 1", "1")])


def test_spawn_start_method():
    with ProcessWorkerPool(math_reward, num_workers=1, timeout_s=TIMEOUT_S, start_method="spawn") as pool:
        batch = pool.score([("q", "\\boxed{\\frac{3}{4}}", "0.75"), ("q", "\\boxed{9^{9^{9^{9}}}}", "1")])
    assert batch == RewardBatch([1.0, 0.0], num_timeouts=1, num_errors=0)
