"""Environments the model acts in: a Python sandbox, tools it may call, and a code environment (HumanEval).

:func:`run_python` runs untrusted code in a separate, limited, isolated process (``sandbox``);
:func:`parse_tool_calls` reads ``<tool_call>`` blocks and :func:`call_tool` runs them with the ``calculator``
and ``python`` tools (``tools``); :func:`score_completion` is the fraction of a HumanEval task's tests a
completion passes in the sandbox (``code``).
"""

from __future__ import annotations

from rlfleet.environments.code import (
    CodeProblem,
    CodeTestReport,
    HumanEvalError,
    load_humaneval,
    run_tests,
    score_completion,
)
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
    "CodeProblem",
    "CodeTestReport",
    "HumanEvalError",
    "Isolation",
    "SandboxError",
    "SandboxLimits",
    "SandboxResult",
    "Tool",
    "ToolCall",
    "ToolCallError",
    "calculator",
    "calculator_tool",
    "call_tool",
    "default_tools",
    "load_humaneval",
    "parse_tool_calls",
    "python_tool",
    "run_python",
    "run_tests",
    "score_completion",
    "tool_schemas",
]
