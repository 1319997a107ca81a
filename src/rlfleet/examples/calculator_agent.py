"""An agent that speaks only the OpenAI API: it answers a multiplication with the calculator tool.

It is the ``tools`` environment's episode written as a user's agent would write it (its own loop, its own
tool, the ``openai`` client), for ``data.env_name=agent`` with
``env.agent.agent_fn=rlfleet.examples.calculator_agent:run``. Given the same rows and seeds it samples what
the ``tools`` environment's episodes sample: the endpoint renders the same prompt and observations and
seeds each request as the turn loop seeds each turn, and the agent answers a malformed call with the
parser's message, as the environment does.
"""

from __future__ import annotations

import json
from typing import Any

from rlfleet.environments.tools import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    ToolCallError,
    calculator,
    calculator_tool,
    parse_tool_calls,
)
from rlfleet.rewards import math_reward

TOOLS = [calculator_tool().schema()]
MAX_TURNS = 3  # grpo.max_rollout_turns (and eval.max_rollout_turns) of the tools recipe
MAX_TOOL_CALLS = 2  # env.tools.max_tool_calls of the tools recipe


def run(task: dict[str, Any], client: Any, model: str) -> float:
    """Plays one episode; returns its reward (1.0 for a right final answer)."""
    messages, calls = list(task["messages"]), 0
    for _ in range(MAX_TURNS):
        reply = client.chat.completions.create(model=model, messages=messages, tools=TOOLS).choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        text = reply.content or ""
        if not reply.tool_calls and (TOOL_CALL_OPEN in text or TOOL_CALL_CLOSE in text):
            # a call the endpoint could not parse: say what was wrong and let the model try again, as the
            # tools environment does
            problem = parse_tool_calls(text, [calculator_tool()])
            note = problem.observation if isinstance(problem, ToolCallError) else "error: malformed tool call"
            messages.append({"role": "tool", "content": note})
            continue
        if not reply.tool_calls:  # the final answer
            return math_reward(task["question"], text, str(task["ground_truth"]))
        for call in reply.tool_calls:
            calls += 1
            if calls > MAX_TOOL_CALLS:
                result = f"error: no more tool calls allowed ({MAX_TOOL_CALLS} per episode); answer now"
            else:
                result = calculator(json.loads(call.function.arguments).get("expression", ""))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return 0.0
