"""Environments the model acts in (NeMo RL's :class:`EnvironmentInterface`): ``math``, ``tools`` (calculator
and Python sandbox), ``code`` (HumanEval), ``reward_model`` (a reward model's score) and ``judge`` (an LLM's
graded verdict), their runners, a Python sandbox and the tool-call parser.

:func:`run_python` runs untrusted code in a separate, limited, isolated process (``sandbox``);
:func:`parse_tool_calls` reads ``<tool_call>`` blocks and :func:`call_tool` runs them with the ``calculator``
and ``python`` tools (``tools``); :func:`score_completion` is the fraction of a HumanEval task's tests a
completion passes in the sandbox (``code``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rlfleet.environments.builtin import CodeEnvironment, MathEnvironment, ToolEnvironment
from rlfleet.environments.code import (
    CodeProblem,
    CodeTestReport,
    HumanEvalError,
    load_humaneval,
    run_tests,
    score_completion,
)
from rlfleet.environments.interface import EnvironmentInterface, EnvironmentReturn, StepOutcome
from rlfleet.environments.runner import EnvironmentLoadError, build_environment, environment_class
from rlfleet.environments.sandbox import Isolation, SandboxError, SandboxLimits, SandboxResult, run_python
from rlfleet.environments.tools import (
    Tool,
    ToolCall,
    ToolCallError,
    calculator,
    calculator_tool,
    call_tool,
    default_tools,
    parse_tool_calls,
    python_tool,
    tool_schemas,
)

__all__ = [
    "CodeEnvironment",
    "CodeProblem",
    "CodeTestReport",
    "EnvironmentInterface",
    "EnvironmentLoadError",
    "EnvironmentReturn",
    "HumanEvalError",
    "Isolation",
    "JudgeEnvironment",
    "MathEnvironment",
    "RewardModelEnvironment",
    "SandboxError",
    "SandboxLimits",
    "SandboxResult",
    "StepOutcome",
    "Tool",
    "ToolCall",
    "ToolCallError",
    "ToolEnvironment",
    "build_environment",
    "calculator",
    "calculator_tool",
    "call_tool",
    "default_tools",
    "environment_class",
    "load_humaneval",
    "parse_tool_calls",
    "python_tool",
    "run_python",
    "run_tests",
    "score_completion",
    "tool_schemas",
]

if TYPE_CHECKING:
    from rlfleet.environments.judge import JudgeEnvironment
    from rlfleet.environments.reward_model import RewardModelEnvironment

_LAZY = {
    "JudgeEnvironment": "rlfleet.environments.judge",
    "RewardModelEnvironment": "rlfleet.environments.reward_model",
}


def __getattr__(name: str) -> Any:
    """The environments that score with a model, imported when first named: they import transformers, which
    a worker that steps ``math`` or ``tools`` never needs."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
