"""The environments rlfleet ships: ``math`` (single turn), ``tools`` (calculator and Python, multi-turn),
``code`` (HumanEval-style tests in the sandbox), two that score with a model, ``reward_model`` and
``judge``, ``agent`` (a user's agent behind the OpenAI API) (those three in their own modules), and
``reasoning_gym`` (a reasoning-gym task's own verifier).

Each reads what it needs from an episode's metadata: ``ground_truth`` (the gold answer) for ``math`` and
``tools``, ``problem`` (a :class:`~rlfleet.environments.code.CodeProblem`) for ``code``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import torch

from rlfleet.answers import extract_answer
from rlfleet.config.schema import BUILTIN_ENVIRONMENTS
from rlfleet.environments.code import CodeProblem, run_tests
from rlfleet.environments.interface import EnvironmentInterface, EnvironmentReturn, MessageLog
from rlfleet.environments.sandbox import SandboxLimits
from rlfleet.environments.tools import (
    TOOL_CALL_CLOSE,
    Tool,
    calculator_tool,
    call_tool,
    parse_tool_calls,
    python_tool,
)
from rlfleet.rewards.loading import RewardFn, load_reward_fn

__all__ = [
    "CodeEnvironment",
    "MathEnvironment",
    "ToolEnvironment",
    "extract_code",
    "first_user",
    "last_assistant",
]

DEFAULT_REWARD_FN = "rlfleet.rewards.math_reward"


def last_assistant(log: MessageLog) -> str:
    """The content of the conversation's latest assistant message ("" if none)."""
    for message in reversed(log):
        if message.get("role") == "assistant":
            return message.get("content", "")
    return ""


def first_user(log: MessageLog) -> str:
    """The content of the conversation's first user message (the task)."""
    return next((m.get("content", "") for m in log if m.get("role") == "user"), "")


class MathEnvironment(EnvironmentInterface[dict[str, Any]]):
    """Single turn, as NeMo RL's ``MathEnvironment``: the reward is ``reward_fn(prompt, response,
    ground_truth)`` (``env.math.reward_fn``) of the conversation's assistant messages joined, the score of
    single-turn GRPO; every episode terminates on its first step.

    cfg: ``reward_fn`` (dotted path, default ``rlfleet.rewards.math_reward``).
    """

    def __init__(self, cfg: Mapping[str, Any] | None = None) -> None:
        super().__init__(cfg)
        self.reward_fn: RewardFn = load_reward_fn(str(self.cfg.get("reward_fn", DEFAULT_REWARD_FN)))

    def step(
        self, message_log_batch: list[MessageLog], metadata: list[dict[str, Any]]
    ) -> EnvironmentReturn[dict[str, Any]]:
        rewards = [
            float(self.reward_fn(first_user(log), assistant_text(log), str(meta["ground_truth"])))
            for log, meta in zip(message_log_batch, metadata, strict=True)
        ]
        return EnvironmentReturn(
            observations=[verdict(r) for r in rewards],
            metadata=list(metadata),
            next_stop_strings=[None] * len(rewards),
            rewards=torch.tensor(rewards, dtype=torch.float32),
            terminateds=torch.ones(len(rewards), dtype=torch.float32),
            answers=None,
        )


def assistant_text(log: MessageLog) -> str:
    """Every assistant message of the conversation, joined (what NeMo RL's math environment scores)."""
    return "".join(m.get("content", "") for m in log if m.get("role") == "assistant")


def verdict(reward: float) -> dict[str, str]:
    """NeMo RL's observation of a scored answer."""
    return {"role": "environment", "content": f"Environment: {'correct' if reward > 0 else 'incorrect'}"}


TOOL_FACTORIES = {"calculator": lambda limits: calculator_tool(), "python": python_tool}


class ToolEnvironment(EnvironmentInterface[dict[str, Any]]):
    """Multi-turn: each model turn either calls tools (``<tool_call>`` JSON, stopped at ``</tool_call>``) and
    gets their results as a ``tool`` message, or answers; the answer is scored as :class:`MathEnvironment`
    does. A malformed call is an observation saying what was wrong (counted in ``tool_errors``).

    cfg: ``tools`` (names, default ``["calculator", "python"]``), ``reward_fn``, ``max_tool_calls`` (per
    episode; a call beyond it is refused with an observation, default 8), ``sandbox`` (keyword arguments of
    :class:`~rlfleet.environments.sandbox.SandboxLimits` for the ``python`` tool).
    """

    stop_strings = (TOOL_CALL_CLOSE,)

    def __init__(self, cfg: Mapping[str, Any] | None = None) -> None:
        super().__init__(cfg)
        self.reward_fn: RewardFn = load_reward_fn(str(self.cfg.get("reward_fn", DEFAULT_REWARD_FN)))
        names = list(self.cfg.get("tools", ["calculator", "python"]))
        unknown = sorted(set(names) - set(TOOL_FACTORIES))
        if unknown or not names:
            raise ValueError(f"env tools: unknown tools {unknown} (known: {sorted(TOOL_FACTORIES)})")
        limits = SandboxLimits(**dict(self.cfg.get("sandbox", {})))
        self.tool_list: list[Tool] = [TOOL_FACTORIES[name](limits) for name in names]
        self.tools = [tool.schema() for tool in self.tool_list]
        self.max_tool_calls = int(self.cfg.get("max_tool_calls", 8))

    def step(
        self, message_log_batch: list[MessageLog], metadata: list[dict[str, Any]]
    ) -> EnvironmentReturn[dict[str, Any]]:
        observations: list[dict[str, str]] = []
        metas: list[dict[str, Any]] = []
        rewards: list[float] = []
        terminateds: list[bool] = []
        answers: list[str | None] = []
        for log, meta in zip(message_log_batch, metadata, strict=True):
            meta = {
                **meta,
                "tool_calls": meta.get("tool_calls", 0),
                "tool_errors": meta.get("tool_errors", 0),
            }
            response = last_assistant(log)
            calls = parse_tool_calls(response, self.tool_list)
            if isinstance(calls, list) and not calls:  # no call: the final answer
                reward = float(self.reward_fn(first_user(log), response, str(meta["ground_truth"])))
                observations.append(verdict(reward))
                rewards.append(reward)
                terminateds.append(True)
                answers.append(response)
            else:
                observations.append({"role": "tool", "content": self._run(calls, meta)})
                rewards.append(0.0)
                terminateds.append(False)
                answers.append(None)
            metas.append(meta)
        stops: list[list[str] | None] = [list(self.stop_strings) for _ in metas]
        return EnvironmentReturn(observations, metas, stops, rewards, terminateds, answers)

    def _run(self, calls: Any, meta: dict[str, Any]) -> str:
        if not isinstance(calls, list):  # a ToolCallError
            meta["tool_errors"] += 1
            return str(calls.observation)
        results = []
        for call in calls:
            if meta["tool_calls"] >= self.max_tool_calls:
                meta["tool_errors"] += 1
                results.append(
                    f"error: no more tool calls allowed ({self.max_tool_calls} per episode); answer now"
                )
                continue
            meta["tool_calls"] += 1
            result = call_tool(call, self.tool_list)
            meta["tool_errors"] += result.startswith("error:")
            results.append(result)
        return "\n".join(results)


_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)


def extract_code(response: str) -> str:
    """The program in a response: its first fenced code block (an unclosed one runs to the end), else the
    whole response (a function body continuing the prompt, as HumanEval completions are)."""
    match = _FENCE.search(response)
    return match.group(1) if match else response


class CodeEnvironment(EnvironmentInterface[dict[str, Any]]):
    """The model writes a function; the reward is the fraction of the task's tests that pass in the sandbox.

    cfg: ``terminate_on_evaluation`` (default true: one attempt; false: the failing-test report comes back
    as a ``user`` message and the model may try again until all pass or the turn limit; the episode's return
    is then the best fraction reached, paid as improvements), ``cpu_seconds`` and ``wall_seconds`` per run.
    """

    def __init__(self, cfg: Mapping[str, Any] | None = None) -> None:
        super().__init__(cfg)
        self.terminate_on_evaluation = bool(self.cfg.get("terminate_on_evaluation", True))
        self.limits = SandboxLimits(
            cpu_seconds=int(self.cfg.get("cpu_seconds", 5)),
            wall_seconds=float(self.cfg.get("wall_seconds", 10.0)),
        )

    def step(
        self, message_log_batch: list[MessageLog], metadata: list[dict[str, Any]]
    ) -> EnvironmentReturn[dict[str, Any]]:
        observations, metas, rewards, terminateds = [], [], [], []
        for log, meta in zip(message_log_batch, metadata, strict=True):
            problem: CodeProblem = meta["problem"]
            report = run_tests(problem, extract_code(last_assistant(log)), self.limits)
            best = float(meta.get("best", 0.0))
            rewards.append(max(report.fraction - best, 0.0))
            metas.append({**meta, "best": max(best, report.fraction)})
            done = self.terminate_on_evaluation or report.fraction >= 1.0
            terminateds.append(done)
            text = f"{report.passed} of {report.total} tests passed."
            if not done:
                text += " Fix the function and write it again.\n" + report.result.observation
            observations.append({"role": "user", "content": text})
        return EnvironmentReturn(observations, metas, [None] * len(metas), rewards, terminateds, None)


_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def reply_answer(reply: str) -> str:
    """The answer a reply gives to a reasoning-gym task: the content of its last ``<answer>...</answer>``
    (reasoning-gym's convention), else its final number as ``math`` reads it (after ``####``, in
    ``\\boxed{}``, else the last number; thousands separators and a closing period dropped), else its last
    line."""
    tagged = _ANSWER_TAG.findall(reply)
    if tagged:
        return str(tagged[-1]).strip()
    number = extract_answer(reply)  # "#### 12", "\\boxed{12}", "... is 1,012." -> the number alone
    if number is not None:
        return number
    lines = [line.strip() for line in reply.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


class ReasoningGymEnvironment(EnvironmentInterface[dict[str, Any]]):
    """Single turn: a reasoning-gym task's own verifier scores the reply. The reward is the row's task's
    ``score_answer(reply_answer(reply), entry)`` (in [0, 1]; partial credit where the task gives it). Rows
    come from ``data.dataset_name=reasoning_gym`` (:mod:`rlfleet.data.reasoning_gym`), carrying their whole
    entry (``rg_entry``)."""

    def __init__(self, cfg: Mapping[str, Any] | None = None) -> None:
        super().__init__(cfg)
        try:
            import reasoning_gym
        except ImportError as exc:
            raise ValueError(
                "the reasoning_gym environment needs the reasoning-gym package: pip install "
                "'rlfleet[reasoning-gym]' (make setup-dev installs it)"
            ) from exc
        self._package = reasoning_gym
        self._scorers: dict[str, Callable[..., Any]] = {}

    def _score(self, entry: Mapping[str, Any], answer: str) -> float:
        task = str(entry["metadata"]["source_dataset"])
        if task not in self._scorers:
            self._scorers[task] = self._package.get_score_answer_fn(task)
        return min(max(float(self._scorers[task](answer=answer, entry=dict(entry))), 0.0), 1.0)

    def step(
        self, message_log_batch: list[MessageLog], metadata: list[dict[str, Any]]
    ) -> EnvironmentReturn[dict[str, Any]]:
        rewards, answers = [], []
        for log, meta in zip(message_log_batch, metadata, strict=True):
            entry = meta.get("rg_entry")
            if not isinstance(entry, Mapping) or not isinstance(entry.get("metadata"), Mapping):
                raise ValueError(
                    "a reasoning_gym row carries its entry (rows of data.dataset_name=reasoning_gym)"
                )
            answers.append(reply_answer(assistant_text(log)))
            rewards.append(self._score(entry, answers[-1]))
        return EnvironmentReturn(
            observations=[verdict(1.0 if r >= 1.0 else 0.0) for r in rewards],
            metadata=list(metadata),
            next_stop_strings=[None] * len(rewards),
            rewards=rewards,
            terminateds=[True] * len(rewards),
            answers=list(answers),
        )


BUILTIN: dict[str, str] = {
    "math": "rlfleet.environments.builtin:MathEnvironment",
    "tools": "rlfleet.environments.builtin:ToolEnvironment",
    "code": "rlfleet.environments.builtin:CodeEnvironment",
    "reward_model": "rlfleet.environments.reward_model:RewardModelEnvironment",
    "judge": "rlfleet.environments.judge:JudgeEnvironment",
    "agent": "rlfleet.environments.agent:AgentEnvironment",
    "reasoning_gym": "rlfleet.environments.builtin:ReasoningGymEnvironment",
}
"""The environments a recipe may name without an import path (``env.<name>`` with these names), each by the
import path of its class: a worker process that steps ``math`` never imports the model-scoring environments
(transformers, the serving stack)."""
assert tuple(BUILTIN) == BUILTIN_ENVIRONMENTS, "BUILTIN follows rlfleet.config.schema.BUILTIN_ENVIRONMENTS"
