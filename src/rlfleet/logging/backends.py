"""Experiment-tracker metric backends: Weights & Biases and MLflow.

Both packages are optional extras and are imported only when a backend is constructed; a missing package
raises :class:`MetricsBackendError` naming the extra to install (``pip install 'rlfleet[wandb]'`` /
``'rlfleet[mlflow]'``).

Resume: each backend keeps its tracker run id in ``<log_dir>/wandb_run_id.txt`` /
``<log_dir>/mlflow_run_id.txt``, so a restarted rlfleet run with the same ``log_dir`` continues the same
tracker run. Neither tracker can delete logged points, so :meth:`~MetricsBackend.truncate_after` cannot
rewrite their history the way ``metrics.jsonl`` is rewritten:

* MLflow: steps after the checkpoint are logged again, so a metric's history holds two points for each
  step that the interrupted attempt logged after the checkpoint (same step, later timestamp). The run is
  tagged ``rlfleet.resumed_from_step``.
* W&B (online): a resumed run only accepts steps at or after its ``starting_step`` (one past the last
  step it recorded); steps before it are skipped here, exactly as W&B itself would drop them, so those
  steps keep the interrupted attempt's values. Offline runs are new local run directories with the same
  id that ``wandb sync`` uploads into one run.

Secrets never come from the config: W&B reads ``WANDB_API_KEY`` and MLflow reads its credentials
(``MLFLOW_TRACKING_TOKEN``, ``MLFLOW_TRACKING_USERNAME``/``PASSWORD``) from the environment themselves, and
the run config is passed through :func:`~rlfleet.logging.metrics.scrub_secrets` before either sees it.
"""

from __future__ import annotations

import importlib
import json
import logging as pylogging
import os
import re
import secrets
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from rlfleet.config.errors import ConfigError
from rlfleet.logging.metrics import MetricsBackend, MetricValue, redact_uri, scrub_secrets, to_json_safe

if TYPE_CHECKING:
    from rlfleet.config.schema import MlflowConfig, WandbConfig

_LOG = pylogging.getLogger(__name__)

WANDB_RUN_ID_FILE = "wandb_run_id.txt"
MLFLOW_RUN_ID_FILE = "mlflow_run_id.txt"

# MLflow limits (also checked by the server); the value limit is read from mlflow when it has one.
_MLFLOW_KEY_MAX = 250
_MLFLOW_PARAM_VALUE_MAX_FALLBACK = 500
_MLFLOW_PARAMS_PER_BATCH = 100
_MLFLOW_METRICS_PER_BATCH = 1000
# The portable MLflow name alphabet (colons are refused by Windows servers and older versions).
_MLFLOW_BAD_CHARS = re.compile(r"[^A-Za-z0-9_\-. /]")


class MetricsBackendError(ConfigError):
    """A tracker backend could not start: its package is missing, or its tracker refused to start a run."""


def _require(module: str, extra: str, key: str) -> ModuleType:
    """Imports an optional dependency or raises an error naming the extra that provides it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MetricsBackendError(
            f"logger.{key}: got true, but the {module!r} package is not installed ({exc}); "
            f"fix: pip install 'rlfleet[{extra}]', or logger.{key}=false"
        ) from exc


def _read_run_id(path: Path) -> str | None:
    try:
        text = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    return text or None


def _write_run_id(path: Path, run_id: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(run_id + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _present(metrics: Mapping[str, MetricValue]) -> dict[str, float | int]:
    """Drops ``None`` (missing or non-finite) values, which neither tracker can store."""
    return {key: value for key, value in metrics.items() if value is not None}


# ----------------------------------------------------------------------------------------------- W&B


def _wandb_reinit(wandb: ModuleType) -> str | bool:
    """``"create_new"`` (an independent run even if another is active) where supported (wandb 0.19.10+)."""
    version = tuple(int(part) for part in re.findall(r"\d+", wandb.__version__)[:3])
    return "create_new" if version >= (0, 19, 10) else True


class WandbBackend(MetricsBackend):
    """Logs scalars to a Weights & Biases run (``run.log(metrics, step=step)``).

    Args:
        cfg: ``logger.wandb``; ``mode=None`` defers to ``WANDB_MODE`` / W&B's default, ``dir=None`` means
            ``<log_dir>/wandb`` (W&B adds its own ``wandb/`` folder inside it).
        log_dir: The run's log directory; holds ``wandb_run_id.txt``.
        run_config: The run configuration, saved as the W&B run config (secret-looking keys scrubbed).
    """

    def __init__(self, cfg: WandbConfig, log_dir: Path, run_config: Mapping[str, Any] | None = None) -> None:
        wandb = _require("wandb", "wandb", "wandb_enabled")
        log_dir = Path(log_dir)
        wandb_dir = Path(cfg.dir) if cfg.dir else log_dir / "wandb"
        wandb_dir.mkdir(parents=True, exist_ok=True)  # W&B falls back to a temp dir if it does not exist
        id_path = log_dir / WANDB_RUN_ID_FILE
        run_id = _read_run_id(id_path)
        if run_id is None:
            run_id = secrets.token_hex(6)
            _write_run_id(id_path, run_id)
        config = to_json_safe(scrub_secrets(run_config)) if run_config else None
        try:
            self.run = wandb.init(
                project=cfg.project,
                name=cfg.name,
                entity=cfg.entity,
                mode=cfg.mode,
                dir=str(wandb_dir),
                config=config,
                id=run_id,
                resume="allow",
                reinit=_wandb_reinit(wandb),
            )
        except wandb.errors.Error as exc:
            raise MetricsBackendError(
                f"logger.wandb_enabled: W&B could not start run {run_id!r} in project {cfg.project!r}: "
                f"{exc}; fix: set WANDB_API_KEY in the environment, or logger.wandb.mode=offline, "
                "or logger.wandb_enabled=false"
            ) from exc
        self.run_id = run_id
        self.min_step = int(getattr(self.run, "starting_step", 0) or 0)
        self._skipped_early = False

    def log(self, step: int, metrics: Mapping[str, MetricValue]) -> None:
        values = _present(metrics)
        if not values:
            return
        if step < self.min_step:  # W&B drops steps before a resumed run's starting step
            if not self._skipped_early:
                _LOG.info(
                    "W&B run %s already holds steps < %d; steps before it are not re-sent",
                    self.run_id,
                    self.min_step,
                )
                self._skipped_early = True
            return
        self.run.log(values, step=step)

    def truncate_after(self, step: int) -> None:
        """No-op: W&B cannot delete logged steps (see the module docstring)."""
        _LOG.debug(
            "W&B keeps steps > %d of run %s; new values are logged from step %d",
            step,
            self.run_id,
            self.min_step,
        )

    def close(self, *, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)


# -------------------------------------------------------------------------------------------- MLflow


def resolve_tracking_uri(cfg: MlflowConfig, log_dir: Path) -> str:
    """``cfg.tracking_uri``, else ``MLFLOW_TRACKING_URI``, else a local file store ``<log_dir>/mlruns``."""
    if cfg.tracking_uri:
        return cfg.tracking_uri
    env_uri = os.environ.get("MLFLOW_TRACKING_URI")
    if env_uri:
        return env_uri
    return (Path(log_dir) / "mlruns").resolve().as_uri()


def mlflow_metric_name(key: str) -> str:
    """Maps a metric key to a name every MLflow store accepts (``/`` kept, other odd characters ``_``).

    ``val:accuracy`` becomes ``val_accuracy``; empty, ``.`` and ``..`` path segments and leading or
    trailing slashes (which MLflow refuses because names double as file paths) are removed.
    """
    name = _MLFLOW_BAD_CHARS.sub("_", key)
    segments = [seg for seg in name.split("/") if seg.strip() not in ("", ".", "..")]
    return "/".join(segments)[:_MLFLOW_KEY_MAX] or "_"


def flatten_config(config: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Yields ``("a.b.c", leaf)`` for every non-mapping leaf of a nested mapping."""
    for key, value in config.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            yield from flatten_config(value, prefix=f"{dotted}.")
        else:
            yield dotted, value


def mlflow_params(config: Mapping[str, Any], value_max: int) -> dict[str, str]:
    """Flattens a (scrubbed) run config into MLflow params: dotted keys, JSON-ish string values, truncated."""
    params: dict[str, str] = {}
    for key, value in flatten_config(to_json_safe(config)):
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        if len(text) > value_max:
            text = text[: value_max - 3] + "..."
        params[mlflow_metric_name(key)] = text
    return params


def _chunks(items: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _error_text(exc: Exception) -> str:
    """An MLflow error's message with URL credentials masked (MLflow quotes request URLs verbatim)."""
    return redact_uri(str(getattr(exc, "message", exc)))


def _is_local_store(uri: str) -> bool:
    return urlparse(uri).scheme in ("", "file")


class MlflowBackend(MetricsBackend):
    """Logs scalars (and the run config as params) to an MLflow run through ``MlflowClient``.

    The client is bound to the resolved tracking URI; the process-wide MLflow state (``mlflow.set_*``,
    the fluent active run) is left alone. A local file store needs ``MLFLOW_ALLOW_FILE_STORE=true`` in
    MLflow 3.x; it is set for this process unless already set.

    Args:
        cfg: ``logger.mlflow``.
        log_dir: The run's log directory; holds ``mlflow_run_id.txt`` and, by default, ``mlruns/``.
        run_config: The run configuration, flattened into params (secret-looking keys scrubbed).
    """

    def __init__(self, cfg: MlflowConfig, log_dir: Path, run_config: Mapping[str, Any] | None = None) -> None:
        _require("mlflow", "mlflow", "mlflow_enabled")
        from mlflow.entities import Metric, Param
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        self._metric_cls, self._param_cls, self._error_cls = Metric, Param, MlflowException
        log_dir = Path(log_dir)
        self.tracking_uri = resolve_tracking_uri(cfg, log_dir)
        if _is_local_store(self.tracking_uri):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self._id_path = log_dir / MLFLOW_RUN_ID_FILE
        try:
            self.client = MlflowClient(tracking_uri=self.tracking_uri)
            experiment_id = self._experiment_id(cfg.experiment_name)
            self.run_id, self.resumed = self._start_run(experiment_id, cfg.run_name)
            if run_config:
                self._log_params(scrub_secrets(run_config))
        except MlflowException as exc:
            message = _error_text(exc)
            error = MetricsBackendError(
                f"logger.mlflow_enabled: MLflow could not start a run in experiment "
                f"{cfg.experiment_name!r} at {redact_uri(self.tracking_uri)}: {message}; "
                "fix: check logger.mlflow.tracking_uri / MLFLOW_TRACKING_URI and the MLFLOW_TRACKING_* "
                "credentials in the environment, or logger.mlflow_enabled=false"
            )
            if message != str(exc.message):  # the original names a URL with credentials: do not chain it
                raise error from None
            raise error from exc
        self._warned = False

    def _experiment_id(self, name: str) -> str:
        experiment = self.client.get_experiment_by_name(name)
        if experiment is None:
            try:
                return str(self.client.create_experiment(name))
            except self._error_cls:  # created concurrently by another process
                experiment = self.client.get_experiment_by_name(name)
                if experiment is None:
                    raise
        if experiment.lifecycle_stage != "active":
            raise MetricsBackendError(
                f"logger.mlflow.experiment_name: experiment {name!r} at {redact_uri(self.tracking_uri)} is "
                "deleted; fix: restore it (mlflow experiments restore) or choose another experiment_name"
            )
        return str(experiment.experiment_id)

    def _start_run(self, experiment_id: str, run_name: str | None) -> tuple[str, bool]:
        """Resumes the run named in ``mlflow_run_id.txt`` when this store has it, else creates one."""
        run_id = _read_run_id(self._id_path)
        if run_id is not None:
            try:
                run = self.client.get_run(run_id)
            except self._error_cls:
                run = None
            active = run is not None and run.info.lifecycle_stage == "active"
            if run is not None and active and run.info.experiment_id == experiment_id:
                self.client.update_run(run_id, status="RUNNING")
                _LOG.info("resuming MLflow run %s", run_id)
                return run_id, True
            _LOG.warning(
                "MLflow run %s from %s is not in experiment %s at %s; starting a new run",
                run_id,
                self._id_path,
                experiment_id,
                redact_uri(self.tracking_uri),
            )
        run = self.client.create_run(
            experiment_id, run_name=run_name, tags={"rlfleet.log_dir": str(self._id_path.parent.resolve())}
        )
        _write_run_id(self._id_path, run.info.run_id)
        return run.info.run_id, False

    def _log_params(self, run_config: Mapping[str, Any]) -> None:
        """Logs the flattened config; on resume, only new keys (MLflow params cannot change)."""
        from mlflow.utils import validation

        value_max = int(getattr(validation, "MAX_PARAM_VAL_LENGTH", _MLFLOW_PARAM_VALUE_MAX_FALLBACK))
        params = mlflow_params(run_config, value_max)
        if self.resumed:
            existing = self.client.get_run(self.run_id).data.params
            changed = sorted(k for k, v in params.items() if k in existing and existing[k] != v)
            if changed:
                _LOG.warning(
                    "MLflow params cannot change; run %s keeps its first values for: %s",
                    self.run_id,
                    ", ".join(changed),
                )
            params = {k: v for k, v in params.items() if k not in existing}
        entries = [self._param_cls(k, v) for k, v in sorted(params.items())]
        for chunk in _chunks(entries, _MLFLOW_PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=list(chunk))

    def log(self, step: int, metrics: Mapping[str, MetricValue]) -> None:
        timestamp = int(time.time() * 1000)
        entries = [
            self._metric_cls(mlflow_metric_name(key), float(value), timestamp, step)
            for key, value in _present(metrics).items()
        ]
        try:
            for chunk in _chunks(entries, _MLFLOW_METRICS_PER_BATCH):
                self.client.log_batch(self.run_id, metrics=list(chunk))
        except self._error_cls as exc:  # a tracker hiccup must not kill training; metrics.jsonl has it
            if not self._warned:
                _LOG.warning(
                    "MLflow logging failed at step %d (further failures are logged at DEBUG): %s",
                    step,
                    _error_text(exc),
                )
                self._warned = True
            else:
                _LOG.debug("MLflow logging failed at step %d: %s", step, _error_text(exc))

    def truncate_after(self, step: int) -> None:
        """MLflow cannot delete points: tags the run; steps > ``step`` get a second, later point each."""
        try:
            self.client.set_tag(self.run_id, "rlfleet.resumed_from_step", str(step))
        except self._error_cls as exc:
            _LOG.warning("could not tag MLflow run %s: %s", self.run_id, _error_text(exc))

    def close(self, *, failed: bool = False) -> None:
        try:
            self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")
        except self._error_cls as exc:
            _LOG.warning("could not finish MLflow run %s: %s", self.run_id, _error_text(exc))
