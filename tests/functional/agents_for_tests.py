"""Agents for tests: functions that speak only the OpenAI API (``env.agent.agent_fn``)."""

from __future__ import annotations

import threading
import time
from typing import Any

from tests.functional.rewards_for_tests import digit_fraction_reward

SEEN: dict[str, list[dict[str, Any]]] = {}
"""Per question, what the endpoint answered to each request (prompt ids, sampled ids, logprobs)."""
_LOCK = threading.Lock()


def _keep(task: dict[str, Any], response: Any) -> None:
    choice = response.choices[0]
    entry = {
        "prompt_token_ids": list(response.prompt_token_ids),
        "token_ids": list(choice.token_ids),
        "logprobs": [t.logprob for t in choice.logprobs.content] if choice.logprobs else None,
    }
    with _LOCK:
        SEEN.setdefault(task["question"], []).append(entry)


def two_turns(task: dict[str, Any], client: Any, model: str) -> float:
    """Answers, is asked to check, answers again; scored on the second answer."""
    messages = list(task["messages"])
    first = client.chat.completions.create(model=model, messages=messages, logprobs=True)
    _keep(task, first)
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "user", "content": "Check it and answer again."})
    second = client.chat.completions.create(model=model, messages=messages, logprobs=True)
    _keep(task, second)
    return digit_fraction_reward(
        task["question"], second.choices[0].message.content or "", task["ground_truth"]
    )


def forgetful(task: dict[str, Any], client: Any, model: str) -> float:
    """Its second request drops the first exchange (an agent that summarises its history)."""
    first = client.chat.completions.create(model=model, messages=task["messages"])
    _keep(task, first)
    second = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Once more: 2 + 2?"}]
    )
    _keep(task, second)
    return 0.5


async def two_turns_async(task: dict[str, Any], client: Any, model: str) -> float:
    messages = list(task["messages"])
    first = await client.chat.completions.create(model=model, messages=messages, logprobs=True)
    _keep(task, first)
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "user", "content": "Check it and answer again."})
    second = await client.chat.completions.create(model=model, messages=messages, logprobs=True)
    _keep(task, second)
    return digit_fraction_reward(
        task["question"], second.choices[0].message.content or "", task["ground_truth"]
    )


def misbehaving(task: dict[str, Any], client: Any, model: str) -> Any:
    """By the row's gold: raises, returns a non-number, hangs past its time (then tries a late request), or
    plays one turn."""
    gold = task["ground_truth"]
    if gold == "1":
        raise RuntimeError("the agent's own bug")
    if gold == "2":
        client.chat.completions.create(model=model, messages=task["messages"])
        return "not a number"
    if gold == "3":
        time.sleep(3.0)
        try:
            client.chat.completions.create(model=model, messages=task["messages"])
        except Exception as exc:  # the episode is closed: the late request is refused
            with _LOCK:
                SEEN.setdefault("late", []).append({"error": str(exc)})
        return 1.0
    response = client.chat.completions.create(model=model, messages=task["messages"])
    _keep(task, response)
    return 0.25
