"""The ``agent`` environment: episodes played by a user's agent that speaks only the OpenAI API.

Its settings are ``env.agent`` (:class:`~rlfleet.config.schema.AgentEnvConfig`). It is not stepped turn by
turn: the agent runs its own loop, calling the policy through an OpenAI-compatible endpoint whose every
sample is recorded; :mod:`rlfleet.rollouts.agents` runs the agents and turns the records into rollouts. This
class loads and checks the agent function (so a bad path fails before any model loads) and owns what the
run started for it (``close``).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from rlfleet.environments.interface import EnvironmentInterface, EnvironmentReturn, MessageLog
from rlfleet.errors import UserError

AgentFn = Callable[..., Any]
"""``(task: dict, client: openai.OpenAI, model: str) -> float``, or an ``async def`` taking an
``openai.AsyncOpenAI`` client."""


class AgentLoadError(UserError, ValueError):
    """``env.agent.agent_fn`` names no function that can be loaded (exit code 2)."""


def load_agent_fn(spec: str) -> AgentFn:
    """The function ``spec`` names: ``package.module:function`` or ``path/to/file.py:function``.

    Raises:
        AgentLoadError: Empty, malformed, not importable, or not a function of three parameters.
    """
    where = f"env.agent.agent_fn={spec!r}"
    source, _, name = spec.strip().rpartition(":")
    if not source or not name:
        raise AgentLoadError(
            f"{where}: give `package.module:function` or `path/to/file.py:function` (the agent to run)"
        )
    try:
        module = _load_file(source) if source.endswith(".py") else importlib.import_module(source)
        fn: AgentFn = getattr(module, name)
    except (ImportError, AttributeError, FileNotFoundError, SyntaxError) as exc:
        raise AgentLoadError(f"{where}: cannot load it ({type(exc).__name__}: {exc})") from exc
    if not callable(fn):
        raise AgentLoadError(f"{where}: {name} is not a function")
    try:
        inspect.signature(fn).bind(object(), object(), object())
    except TypeError:
        raise AgentLoadError(
            f"{where}: the agent is called as {name}(task, client, model); its parameters do not take that"
        ) from None
    return fn


def _load_file(path: str) -> Any:
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise FileNotFoundError(f"no file {file}")
    module_name = f"rlfleet_agent_{abs(hash(str(file)))}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


class AgentEnvironment(EnvironmentInterface[dict[str, Any]]):
    """The agent function and its settings (cfg: ``agent_fn``, ``max_concurrency``, ``timeout_s``,
    ``max_requests``, ``served_model_name``: the keys of ``env.agent``)."""

    def __init__(self, cfg: Mapping[str, Any] | None = None) -> None:
        super().__init__(cfg)
        self.agent_fn = load_agent_fn(str(self.cfg.get("agent_fn", "")))
        self.is_async = inspect.iscoroutinefunction(self.agent_fn)
        self.max_concurrency = int(self.cfg.get("max_concurrency", 32))
        self.timeout_s = float(self.cfg.get("timeout_s", 300.0))
        self.max_requests = int(self.cfg.get("max_requests", 32))
        self.served_model_name = str(self.cfg.get("served_model_name", "policy"))
        self._closers: list[Callable[[], None]] = []

    def step(
        self, message_log_batch: list[MessageLog], metadata: list[dict[str, Any]]
    ) -> EnvironmentReturn[dict[str, Any]]:
        raise TypeError(
            "agent episodes are played by their agent function (rlfleet.rollouts.agents), never stepped"
        )

    def on_close(self, closer: Callable[[], None]) -> None:
        """Registers what ``close`` stops (the endpoint the run started for the agents)."""
        self._closers.append(closer)

    def close(self) -> None:
        closers, self._closers = self._closers, []
        for closer in reversed(closers):
            closer()
