"""RayWorkerPool: the scores of the reward function, in order, through killed, crashed and stuck actors."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import ray
import ray.exceptions

from rlfleet.pools.ray_pool import RayWorkerPool
from rlfleet.rewards import math_reward

pytestmark = [pytest.mark.timeout(60)]  # a pool that hangs fails instead


def faulty_math_reward(prompt: str, response: str, gold: str) -> float:
    """``math_reward``, with faults chosen by the prompt.

    ``mark:PATH``: write this actor's id to PATH, then pause 1 s (for a kill to land mid-chunk).
    ``crash:PATH``: exit the process at once, the first time only (PATH records that it happened).
    ``sleep``: sleep for an hour, interruptibly. ``hang``: block ``SIGALRM``, then sleep for an hour.
    ``raise``: raise ValueError.
    """
    kind, _, path = prompt.partition(":")
    if kind == "mark":
        Path(path).write_text(ray.get_runtime_context().get_actor_id())
        time.sleep(1.0)
    elif kind == "crash" and not Path(path).exists():
        Path(path).touch()
        os._exit(1)
    elif kind in ("sleep", "hang"):
        if kind == "hang":
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        time.sleep(3600)
    elif kind == "raise":
        raise ValueError("a broken reward function")
    return math_reward(prompt, response, gold)


WORKED = "Natalia sold 48/2 = 24 clips in May.\nNatalia sold 48+24 = 72 clips altogether in April and May."
GSM8K_ITEMS = [
    ("q", f"{WORKED}\n#### 72", "72"),  # right
    ("q", f"{WORKED} so the answer is \\boxed{{71}}.", "72"),  # wrong
    ("q", "I do not know.", "72"),  # no answer
    ("q", "The answer is 1,234.", "1234"),  # right, with a thousands separator
    ("q", "#### seventy-two", "72"),  # unparsable
    ("q", "So she pays $18.", "18"),  # right, currency
    ("q", "\\boxed{\\frac{3}{4}}", "0.75"),  # right, symbolically
    ("q", "#### 73", "72"),  # wrong
    ("q", "5 + 5 = 10\n#### 10", "10"),  # right
    ("q", "", "3"),  # empty
]
EXPECTED = [math_reward(*item) for item in GSM8K_ITEMS]


def test_expected_scores_are_mixed() -> None:
    assert 1.0 in EXPECTED and 0.0 in EXPECTED and sorted(EXPECTED) != EXPECTED


def test_needs_ray_initialised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match="needs Ray initialised"):
        RayWorkerPool(math_reward, num_workers=1, timeout_s=1.0)


def test_scores_equal_the_reward_function_in_input_order(ray_cluster: None) -> None:
    items = GSM8K_ITEMS * 3
    with RayWorkerPool("rlfleet.rewards.math_reward", num_workers=2, timeout_s=5.0, chunk_size=3) as pool:
        batch = pool.score(items)
        assert batch.rewards == EXPECTED * 3
        assert (batch.num_timeouts, batch.num_errors, pool.num_restarts) == (0, 0, 0)
        assert pool.score([]).rewards == []


@pytest.mark.parametrize("fault", ["kill", "crash"])
def test_a_killed_or_crashed_actor_is_replaced_and_its_items_rerun(
    ray_cluster: None, tmp_path: Path, fault: str
) -> None:
    marker = tmp_path / "marker"
    prompt = f"mark:{marker}" if fault == "kill" else f"crash:{marker}"
    items = [*GSM8K_ITEMS[:5], (prompt, "#### 72", "72"), *GSM8K_ITEMS[5:]]
    expected = [*EXPECTED[:5], 1.0, *EXPECTED[5:]]
    killed: list[str] = []
    with RayWorkerPool(faulty_math_reward, num_workers=2, timeout_s=5.0, chunk_size=3) as pool:
        pool.wait_ready()
        before = set(pool.actor_ids())

        def kill_the_marked_actor() -> None:  # the actor sleeps 1 s after writing the marker
            deadline = time.monotonic() + 30.0
            while not marker.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.1)  # the write may be under way
            actor_id = marker.read_text()
            ray.kill(dict(zip(pool.actor_ids(), pool.actors, strict=True))[actor_id], no_restart=True)
            killed.append(actor_id)

        killer = threading.Thread(target=kill_the_marked_actor, daemon=True)
        if fault == "kill":
            killer.start()
        batch = pool.score(items)
        if fault == "kill":
            killer.join(30.0)
        assert marker.exists()
        assert batch.rewards == expected
        assert (batch.num_timeouts, batch.num_errors) == (0, 0)
        assert pool.num_restarts >= 1
        assert len(before - set(pool.actor_ids())) == pool.num_restarts
        if fault == "kill":
            assert killed and killed[0] in before and killed[0] not in pool.actor_ids()
        assert pool.score(GSM8K_ITEMS).rewards == EXPECTED  # the pool is still usable


def test_a_stuck_response_times_out_alone_and_the_pool_recovers(ray_cluster: None) -> None:
    items = [*GSM8K_ITEMS[:2], ("hang", "#### 1", "1"), *GSM8K_ITEMS[2:6]]
    expected = [*EXPECTED[:2], 0.0, *EXPECTED[2:6]]
    pool = RayWorkerPool(
        faulty_math_reward, num_workers=2, timeout_s=1.0, max_retries=1, chunk_size=3, slack_s=0.5
    )
    with pool:
        pool.wait_ready()
        batch = pool.score(items)
        assert batch.rewards == expected
        assert (batch.num_timeouts, batch.num_errors) == (1, 0)
        # its chunk missed its deadline, then alone: the first run and 1 retry; each a restart
        assert pool.num_restarts == 3
        assert pool.score(GSM8K_ITEMS).rewards == EXPECTED


def test_slow_and_failing_responses_count_without_restarts(
    ray_cluster: None, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="rlfleet.pools.process_pool")
    items = [
        ("sleep", "#### 1", "1"),
        *GSM8K_ITEMS[:3],
        ("raise", "#### 1", "1"),
        ("q", "#### 72", WORKED),  # a gold that is no answer: an error, not a wrong response
        ("q", "#### 72", f"{WORKED}\n#### 72"),  # a worked solution: reduced to its answer
    ]
    with RayWorkerPool(faulty_math_reward, num_workers=2, timeout_s=1.0, chunk_size=1) as pool:
        pool.wait_ready()
        batch = pool.score(items)
        assert batch.rewards == [0.0, *EXPECTED[:3], 0.0, 0.0, 1.0]
        # no restart: the soft budget (0.8 s) interrupted the sleep; no actor was killed at its deadline
        assert (batch.num_timeouts, batch.num_errors, pool.num_restarts) == (1, 2, 0)
    logged = sorted(record.getMessage() for record in caplog.records)
    assert len(logged) == 2, logged
    assert "raised InvalidGoldError: gold 'Natalia sold" in logged[0] and "spans several lines" in logged[0]
    assert "raised ValueError: a broken reward function" in logged[1]


def test_close_removes_the_actors(ray_cluster: None) -> None:
    total = ray.cluster_resources()["CPU"]
    pool = RayWorkerPool(math_reward, num_workers=2, timeout_s=1.0)
    pool.wait_ready()
    actors = pool.actors
    assert len(set(pool.actor_ids())) == 2
    assert ray.available_resources().get("CPU", 0.0) <= total - 0.5
    pool.close()
    pool.close()  # idempotent
    assert pool.actor_ids() == []
    with pytest.raises(RuntimeError, match="closed"):
        pool.score(GSM8K_ITEMS)
    deadline = time.monotonic() + 30.0  # ray.kill is asynchronous
    while ray.available_resources().get("CPU", 0.0) < total and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.available_resources().get("CPU", 0.0) == total
    for actor in actors:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.ready.remote(), timeout=30.0)
