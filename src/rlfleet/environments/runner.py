"""Where an environment's steps run, and what one bad item costs: that item only.

* :class:`InProcessRunner` (``env.<name>.num_workers=0``) calls ``step`` on the whole batch in the trainer; if
  the call raises or returns something malformed, each item is stepped alone so that only the bad ones fail.
  Nothing bounds its time: an environment that may hang belongs in workers.
* :class:`PooledRunner` (``num_workers >= 1``) steps each item in worker processes, or Ray actors when the run
  is on Ray: the reward pools' machinery (:class:`~rlfleet.rewards.ProcessWorkerPool`,
  :class:`~rlfleet.pools.ray_pool.RayWorkerPool`), with the same per-item time bound (``timeout_s``),
  restart of a dead or stuck worker, and counting.

A failed item (raised, timed out, malformed) ends its episode with reward 0, counts in
``train/reward_errors`` or ``train/reward_timeouts``, and the first failure of each kind is logged.
"""

from __future__ import annotations

import importlib
import json
import logging
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

from rlfleet.environments.builtin import BUILTIN
from rlfleet.environments.interface import (
    EnvironmentInterface,
    MalformedReturn,
    MessageLog,
    StepOutcome,
    split_return,
)
from rlfleet.errors import UserError
from rlfleet.pools.process_pool import WorkerPool

log = logging.getLogger(__name__)

STEP_IN_WORKER = "rlfleet.environments.runner.step_in_worker"


class EnvironmentLoadError(UserError, ValueError):
    """An environment class that cannot be found, imported or constructed (exit code 2)."""


def environment_class(path: str) -> type[EnvironmentInterface[Any]]:
    """The class named by ``path``: a built-in name (``math``, ``tools``, ``code``), ``package.module:Class``
    or ``package.module.Class``.

    Raises:
        EnvironmentLoadError: It cannot be imported or is not an :class:`EnvironmentInterface` subclass.
    """
    path = BUILTIN.get(path, path)
    module_name, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not module_name or not attr:
        raise EnvironmentLoadError(f"environment {path!r} is not an import path like 'my_pkg.envs:MyEnv'")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise EnvironmentLoadError(
            f"cannot import environment {path!r}: {exc}; give the import path of a class in a module "
            "importable here and in worker processes"
        ) from exc
    if not (isinstance(cls, type) and issubclass(cls, EnvironmentInterface)):
        raise EnvironmentLoadError(f"environment {path!r} is not a subclass of EnvironmentInterface")
    return cls


def build_environment(path: str, cfg: Mapping[str, Any]) -> EnvironmentInterface[Any]:
    """An instance of ``path``'s class built with ``cfg``.

    Raises:
        EnvironmentLoadError: The class cannot be loaded, or a user's class's constructor raised.
        UserError: A constructor's own user error (``RewardFnError`` for a reward function that does not
            import), unchanged.
    """
    cls = environment_class(path)
    with _construction_errors(path, cfg):
        return cls(dict(cfg))
    raise AssertionError("unreachable")  # mypy: the context manager may swallow (it never does)


def preflight_environment(path: str, cfg: Mapping[str, Any]) -> None:
    """What :func:`build_environment` would raise for ``cfg``, found by the class's ``preflight`` (no model
    loaded by the built-in classes that score with one)."""
    cls = environment_class(path)
    with _construction_errors(path, cfg):
        cls.preflight(dict(cfg))


@contextmanager
def _construction_errors(path: str, cfg: Mapping[str, Any]) -> Iterator[None]:
    try:
        yield
    except UserError:
        raise  # it says what to fix already (a reward function that does not import, say)
    except Exception as exc:
        if path in BUILTIN and not isinstance(exc, (ValueError, TypeError, KeyError)):
            raise  # not a bad cfg: a bug, in the built-in class or in code it imports (a reward module)
        raise EnvironmentLoadError(
            f"environment {path!r} could not be built from cfg {dict(cfg)}: {exc!r}"
        ) from exc


# --------------------------------------------------------------------------------------- inside a worker

_INSTANCES: dict[tuple[str, str], EnvironmentInterface[Any]] = {}


def step_in_worker(path: str, cfg_json: str, message_log: MessageLog, metadata: Any) -> StepOutcome:
    """One item's step, in a pool worker (the instance is built once per worker and kept)."""
    key = (path, cfg_json)
    if key not in _INSTANCES:
        _INSTANCES[key] = build_environment(path, json.loads(cfg_json))
    return split_return(_INSTANCES[key].step([message_log], [metadata]), 1)[0]


def checked_outcome(value: Any) -> StepOutcome:
    """The pool's ``convert``: a worker must return a :class:`StepOutcome`."""
    if not isinstance(value, StepOutcome):
        raise MalformedReturn(f"expected a StepOutcome, got {type(value).__name__}")
    return value


# ------------------------------------------------------------------------------------------ the runners


@dataclass(frozen=True)
class StepReport:
    """One batched step: an outcome per item (None for a failed item) and the failures' counts."""

    outcomes: list[StepOutcome | None]
    num_timeouts: int = 0
    num_errors: int = 0


class EnvRunner(Protocol):
    environment: EnvironmentInterface[Any]  # the trainer's own instance (stop strings, tools, metrics)

    def step(self, logs: Sequence[MessageLog], metadata: Sequence[Any]) -> StepReport: ...

    def close(self) -> None: ...


class InProcessRunner:
    """Steps the batch in this process, falling back to one item at a time when the batch fails."""

    def __init__(self, name: str, environment: EnvironmentInterface[Any]) -> None:
        self.name, self.environment = name, environment
        self._logged: set[str] = set()

    def step(self, logs: Sequence[MessageLog], metadata: Sequence[Any]) -> StepReport:
        if not logs:
            return StepReport([])
        try:
            return StepReport(list(self._call(list(logs), list(metadata))))
        except Exception as exc:
            if len(logs) == 1:
                self._log_once(exc)
                return StepReport([None], num_errors=1)
        outcomes: list[StepOutcome | None] = []
        errors = 0
        for one_log, meta in zip(logs, metadata, strict=True):
            try:
                outcomes.append(self._call([one_log], [meta])[0])
            except Exception as exc:
                self._log_once(exc)
                outcomes.append(None)
                errors += 1
        return StepReport(outcomes, num_errors=errors)

    def _call(self, logs: list[MessageLog], metadata: list[Any]) -> list[StepOutcome]:
        return split_return(self.environment.step(logs, metadata), len(logs))

    def _log_once(self, exc: Exception) -> None:
        kind = type(exc).__name__
        if kind not in self._logged:
            self._logged.add(kind)
            log.error(
                "environment %s failed on an item (%s: %s); such items end with reward 0 and count in "
                "train/reward_errors; further %s errors are counted, not logged",
                self.name,
                kind,
                str(exc)[:500],
                kind,
            )

    def close(self) -> None:
        """Closes the environment when it has something to stop (``close()``: a judge's vLLM engine)."""
        close = getattr(self.environment, "close", None)
        if callable(close):
            close()


class PooledRunner:
    """Steps each item in a pool's workers (processes or Ray actors), each within the pool's time bound."""

    def __init__(
        self,
        name: str,
        path: str,
        cfg: Mapping[str, Any],
        environment: EnvironmentInterface[Any],
        pool: WorkerPool,
    ) -> None:
        self.name, self.path, self.environment, self.pool = name, path, environment, pool
        self.cfg_json = json.dumps(dict(cfg), sort_keys=True)

    def step(self, logs: Sequence[MessageLog], metadata: Sequence[Any]) -> StepReport:
        if not logs:
            return StepReport([])
        items = [
            (self.path, self.cfg_json, one_log, meta) for one_log, meta in zip(logs, metadata, strict=True)
        ]
        result = self.pool.run(items)
        return StepReport(list(result.values), result.num_timeouts, result.num_errors)

    def close(self) -> None:
        self.pool.close()
