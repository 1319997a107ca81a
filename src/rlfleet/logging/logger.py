"""The run's metrics logger: one ``log(step, metrics)`` fanned out to every enabled sink.

``metrics.jsonl`` always (:mod:`rlfleet.logging.metrics`), plus TensorBoard, Weights & Biases and MLflow
(:mod:`rlfleet.logging.backends`) when the recipe's ``logger`` section enables them. The run config is
passed through :func:`~rlfleet.logging.metrics.scrub_secrets` before it reaches any file or backend.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from rlfleet.logging.backends import MlflowBackend, WandbBackend
from rlfleet.logging.metrics import (
    RUN_CONFIG_FILE,
    SAMPLES_FILE,
    JsonlBackend,
    JsonlFile,
    MetricsBackend,
    TensorboardBackend,
    atomic_write_text,
    scrub_secrets,
    to_json_safe,
    to_scalar,
)

if TYPE_CHECKING:
    from rlfleet.config.schema import LoggerConfig, MlflowConfig, WandbConfig


class MetricsLogger:
    """Logs flat scalar metrics (and generation samples) for a training run.

    Args:
        log_dir: Directory for ``metrics.jsonl``, ``samples.jsonl`` and ``run_config.json``.
        tensorboard_enabled: Whether to also write TensorBoard event files.
        tensorboard_dir: Where TensorBoard events go; defaults to ``<log_dir>/tensorboard``.
        run_config: Optional run configuration, saved (secrets scrubbed, see :func:`scrub_secrets`) as
            ``<log_dir>/run_config.json``, as TensorBoard text, as the W&B run config and as MLflow params.
        wandb: ``logger.wandb`` settings to also log to Weights & Biases; ``None`` disables it.
        mlflow: ``logger.mlflow`` settings to also log to MLflow; ``None`` disables it.

    Raises:
        MetricsBackendError: An enabled W&B / MLflow backend is not installed or could not start a run
            (backends already started are closed first).
    """

    def __init__(
        self,
        log_dir: Path,
        *,
        tensorboard_enabled: bool,
        tensorboard_dir: Path | None = None,
        run_config: dict[str, Any] | None = None,
        wandb: WandbConfig | None = None,
        mlflow: MlflowConfig | None = None,
    ) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        config = scrub_secrets(run_config) if run_config is not None else None
        if config is not None:
            text = json.dumps(to_json_safe(config), indent=2, sort_keys=True, allow_nan=False)
            atomic_write_text(self.log_dir / RUN_CONFIG_FILE, text + "\n")
        self.backends: list[MetricsBackend] = [JsonlBackend(self.log_dir)]
        try:
            if tensorboard_enabled:
                tb_dir = (
                    Path(tensorboard_dir) if tensorboard_dir is not None else self.log_dir / "tensorboard"
                )
                self.backends.append(TensorboardBackend(tb_dir, config))
            if wandb is not None:
                self.backends.append(WandbBackend(wandb, self.log_dir, config))
            if mlflow is not None:
                self.backends.append(MlflowBackend(mlflow, self.log_dir, config))
        except Exception:
            for backend in self.backends:
                backend.close(failed=True)
            raise
        self._samples = JsonlFile(self.log_dir / SAMPLES_FILE)
        self._closed = False

    @classmethod
    def from_config(cls, logger_cfg: LoggerConfig, run_config: dict[str, Any] | None = None) -> MetricsLogger:
        """Builds the logger a recipe's ``logger`` section asks for (TensorBoard, W&B, MLflow)."""
        tb_dir = logger_cfg.tensorboard.log_dir
        return cls(
            Path(logger_cfg.log_dir),
            tensorboard_enabled=logger_cfg.tensorboard_enabled,
            tensorboard_dir=Path(tb_dir) if tb_dir else None,
            run_config=run_config,
            wandb=logger_cfg.wandb if logger_cfg.wandb_enabled else None,
            mlflow=logger_cfg.mlflow if logger_cfg.mlflow_enabled else None,
        )

    @property
    def samples_path(self) -> Path:
        return self.log_dir / SAMPLES_FILE

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Logs flat scalar ``metrics`` (e.g. ``{"train/reward": 0.4}``) for ``step``.

        Tensor / numpy scalars are converted with ``float()``; NaN and inf are stored as ``null``.
        """
        clean = {str(key): to_scalar(value) for key, value in metrics.items() if key != "step"}
        for backend in self.backends:
            backend.log(int(step), clean)

    def log_samples(self, step: int, samples: Sequence[Mapping[str, Any]]) -> None:
        """Appends one ``{"step": step, **sample}`` line per sample to ``samples.jsonl``."""
        for sample in samples:
            fields = {str(k): to_json_safe(v) for k, v in sample.items() if k != "step"}
            self._samples.append({"step": int(step), **fields})

    def truncate_after(self, step: int) -> None:
        """Drops everything logged after ``step`` (call when resuming from a checkpoint at ``step``)."""
        for backend in self.backends:
            backend.truncate_after(step)
        self._samples.truncate_after(step)

    def close(self, *, failed: bool = False) -> None:
        """Flushes and closes every backend (``failed`` marks tracker runs failed); safe to call twice."""
        if self._closed:
            return
        self._closed = True
        for backend in self.backends:
            backend.close(failed=failed)
        self._samples.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close(failed=exc is not None)
