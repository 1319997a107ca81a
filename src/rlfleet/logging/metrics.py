"""Metric records and the built-in sinks: JSON-lines files (always) and TensorBoard.

Each logged step is one flat JSON object in ``<log_dir>/metrics.jsonl`` (see :class:`JsonlBackend`)::

    {"step": 12, "train/reward": 0.43, "val/accuracy": null, "timing/generation": 1.9}

Lines are flushed as they are written, so a killed process keeps everything it logged. On resume from a
checkpoint at step ``k``, ``truncate_after`` drops every line with ``step > k`` (and any
torn last line), so the resumed run ends with the same file as an uninterrupted one.

Backends are small objects with ``log(step, metrics)``, ``truncate_after(step)`` and ``close()``; adding
another sink means writing one :class:`MetricsBackend` subclass. The W&B and MLflow backends live in
:mod:`rlfleet.logging.backends`; :class:`~rlfleet.logging.logger.MetricsLogger`
fans each step out to the enabled ones. This module imports neither.

The run config is passed through :func:`scrub_secrets` before it reaches any file or backend: values of
secret-looking keys become ``"***"`` and credentials embedded in URLs are masked. API keys and tokens
belong in the environment (``WANDB_API_KEY``, ``MLFLOW_TRACKING_TOKEN``, ``HF_TOKEN``), never in a recipe.
"""

from __future__ import annotations

import json
import logging as pylogging
import math
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any

_LOG = pylogging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
RUN_CONFIG_FILE = "run_config.json"

MetricValue = float | int | None

SECRET_MASK = "***"
# A key names a secret when it has one of these words anywhere ...
_SECRET_WORDS = frozenset(
    {"password", "passwd", "passphrase", "secret", "secrets", "credential", "credentials", "apikey"}
)
# ... or ends in "token" (not a tokenizer's special token: pad_token, eos_token, ...) ...
_SPECIAL_TOKEN_ROLES = frozenset({"pad", "eos", "bos", "unk", "sep", "cls", "mask"})
# ... or ends in "key" after one of these words (so input_key, output_key, num_key_value_heads are kept).
_SECRET_KEY_KINDS = frozenset(
    {"api", "access", "private", "auth", "signing", "encryption", "license", "client", "service", "ssh"}
)
_URL_USERINFO = re.compile(r"(?<=://)[^/@\s]+@")


def looks_secret(name: str) -> bool:
    """Whether a config key names a secret (password, secret, API key, access token, ...).

    Words are split on non-alphanumerics and camelCase. ``hf_token``, ``WANDB_API_KEY``, ``apiKey``,
    ``client_secret`` and ``db_password`` match; the schema's ``token_level_loss``, ``max_new_tokens``,
    ``data.input_key`` and ``num_key_value_heads`` do not, nor does a tokenizer's ``pad_token``.
    """
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower()
    words = [word for word in re.split(r"[^a-z0-9]+", spaced) if word]
    if not words:
        return False
    if any(word in _SECRET_WORDS for word in words):
        return True
    previous = words[-2] if len(words) > 1 else ""
    if words[-1] == "token":
        return previous not in _SPECIAL_TOKEN_ROLES
    return words[-1] == "key" and (previous in _SECRET_KEY_KINDS or len(words) == 1)


def redact_uri(text: str) -> str:
    """Masks the ``user:password@`` part of any URL in ``text``."""
    return _URL_USERINFO.sub(f"{SECRET_MASK}@", text)


def scrub_secrets(config: Any) -> Any:
    """A copy of ``config`` with secret-looking keys' values set to ``"***"`` and URL credentials masked.

    ``None`` values stay ``None`` (nothing to hide, and it shows the setting is unset).
    """
    if isinstance(config, Mapping):
        return {
            key: SECRET_MASK if looks_secret(str(key)) and value is not None else scrub_secrets(value)
            for key, value in config.items()
        }
    if isinstance(config, list | tuple):
        return [scrub_secrets(value) for value in config]
    if isinstance(config, str):
        return redact_uri(config)
    return config


def to_scalar(value: Any) -> MetricValue:
    """Converts a Python / numpy / torch scalar to ``int`` or ``float``; NaN and inf become ``None``."""
    if value is None:
        return None
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if hasattr(value, "item"):  # torch tensors and numpy scalars / 0-d arrays
        value = value.item()
        if isinstance(value, bool):
            return int(value)
        if isinstance(value, int):
            return value
    result = float(value)
    return result if math.isfinite(result) else None


def to_json_safe(value: Any) -> Any:
    """Makes an arbitrary sample field JSON-serialisable (non-finite floats become ``None``)."""
    if isinstance(value, str | bool) or value is None:
        return value
    if isinstance(value, Mapping):
        return {str(k): to_json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_json_safe(v) for v in value]
    if isinstance(value, int | float) or hasattr(value, "item"):
        try:
            return to_scalar(value)
        except (TypeError, ValueError, RuntimeError):  # multi-element arrays/tensors
            pass
    if hasattr(value, "tolist"):
        return to_json_safe(value.tolist())
    return str(value)


def _dumps(obj: Mapping[str, Any]) -> str:
    return json.dumps(obj, ensure_ascii=False, allow_nan=False)


def _iter_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    """Yields the JSON objects of a JSON-lines file, skipping blank and torn (unparseable) lines."""
    if not path.exists():
        return
    with path.open("r", encoding="utf-8", errors="replace") as handle:
        for lineno, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                _LOG.warning("%s:%d: skipping torn/invalid JSON line", path, lineno)
                continue
            if isinstance(record, dict):
                yield record


def read_jsonl(path: Path | str) -> list[dict[str, Any]]:
    """Reads a JSON-lines file into a list of dicts, skipping torn lines; a missing file gives ``[]``."""
    return list(_iter_jsonl(Path(path)))


def read_metrics(log_dir: Path | str) -> list[dict[str, Any]]:
    """Reads ``<log_dir>/metrics.jsonl`` (one dict per logged step, in file order)."""
    return read_jsonl(Path(log_dir) / METRICS_FILE)


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def write_jsonl(path: Path, records: Iterable[Mapping[str, Any]]) -> None:
    """Writes ``records`` as a whole JSON-lines file (atomically: a reader never sees half of it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, "".join(_dumps(record) + "\n" for record in records))


class JsonlFile:
    """An append-only JSON-lines file that is flushed after every line and can be truncated by step."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._handle: IO[str] | None = None

    def _open(self) -> IO[str]:
        if self._handle is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            needs_newline = False
            if self.path.exists() and self.path.stat().st_size > 0:
                with self.path.open("rb") as raw:
                    raw.seek(-1, os.SEEK_END)
                    needs_newline = raw.read(1) != b"\n"
            self._handle = self.path.open("a", encoding="utf-8")
            if needs_newline:  # a torn last line: never glue the next record onto it
                self._handle.write("\n")
        return self._handle

    def append(self, record: Mapping[str, Any]) -> None:
        handle = self._open()
        handle.write(_dumps(record) + "\n")
        handle.flush()

    def truncate_after(self, step: int) -> None:
        """Atomically keeps only the parseable lines whose integer ``step`` is ``<= step``."""
        self.close()
        if not self.path.exists():
            return
        kept = [
            _dumps(record) + "\n"
            for record in _iter_jsonl(self.path)
            if isinstance(record.get("step"), int) and record["step"] <= step
        ]
        atomic_write_text(self.path, "".join(kept))

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None


class MetricsBackend:
    """Base class of a metrics sink. Subclasses implement :meth:`log`; the rest are optional."""

    def log(self, step: int, metrics: Mapping[str, MetricValue]) -> None:
        """Records already-sanitised ``metrics`` (``None`` = non-finite value) for ``step``."""
        raise NotImplementedError

    def truncate_after(self, step: int) -> None:
        """Forgets everything logged after ``step`` (resume). Sinks that cannot rewrite history no-op."""
        del step

    def close(self, *, failed: bool = False) -> None:
        """Flushes and releases resources; ``failed`` marks the run as failed where the sink records it."""
        del failed


class JsonlBackend(MetricsBackend):
    """Appends one flat JSON object per step to ``<log_dir>/metrics.jsonl``."""

    def __init__(self, log_dir: Path) -> None:
        self.file = JsonlFile(log_dir / METRICS_FILE)

    def log(self, step: int, metrics: Mapping[str, MetricValue]) -> None:
        self.file.append({"step": step, **metrics})

    def truncate_after(self, step: int) -> None:
        self.file.truncate_after(step)

    def close(self, *, failed: bool = False) -> None:
        del failed
        self.file.close()


class TensorboardBackend(MetricsBackend):
    """Writes each metric as a TensorBoard scalar (non-finite values are skipped)."""

    def __init__(self, tb_dir: Path, run_config: Mapping[str, Any] | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter  # heavy import: only when enabled

        self._writer_cls = SummaryWriter
        self.tb_dir = tb_dir
        tb_dir.mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(log_dir=str(tb_dir), flush_secs=30)
        if run_config:
            config_text = json.dumps(to_json_safe(run_config), indent=2, sort_keys=True)
            self.writer.add_text("run_config", f"```\n{config_text}\n```", global_step=0)

    def log(self, step: int, metrics: Mapping[str, MetricValue]) -> None:
        for key, value in metrics.items():
            if value is not None:
                self.writer.add_scalar(key, value, global_step=step)

    def truncate_after(self, step: int) -> None:
        # Reopening with ``purge_step`` hides events at ``>= step + 1`` from older event files.
        self.writer.close()
        self.writer = self._writer_cls(log_dir=str(self.tb_dir), flush_secs=30, purge_step=step + 1)

    def close(self, *, failed: bool = False) -> None:
        del failed
        self.writer.flush()
        self.writer.close()
