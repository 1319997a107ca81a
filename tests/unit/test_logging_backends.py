"""Unit tests for the W&B (offline) and MLflow (local file store) metric backends; nothing leaves the host."""

from __future__ import annotations

import json
import math
import struct
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rlfleet.config import ConfigError, ensure_runnable, schema_keys
from rlfleet.config.schema import LoggerConfig, MasterConfig, MlflowConfig, WandbConfig
from rlfleet.logging import MetricsBackendError, MetricsLogger, MlflowBackend, WandbBackend, scrub_secrets
from rlfleet.logging.backends import mlflow_metric_name, mlflow_params
from rlfleet.logging.metrics import JsonlBackend, looks_secret

wandb = pytest.importorskip("wandb")
pytest.importorskip("mlflow")
from mlflow.tracking import MlflowClient  # noqa: E402
from wandb.proto import wandb_internal_pb2  # noqa: E402

RUN_CONFIG = {
    "policy": {"model_name": "tiny-model", "tokenizer": {"name": "tiny-tok"}, "max_new_tokens": 16},
    "grpo": {"num_prompts_per_step": 4, "lr": 1e-5, "ops": ["+", "-"], "enabled": True, "unset": None},
}


@pytest.fixture(autouse=True)
def _offline_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """W&B offline and quiet, its state under tmp; MLflow local; no tracker credentials from the host."""
    home = tmp_path / "wandb-home"
    for name, value in {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_DISABLE_GIT": "true",
        "WANDB_DISABLE_CODE": "true",
        "WANDB_CONSOLE": "off",
        "WANDB__DISABLE_STATS": "true",
        "WANDB__DISABLE_META": "true",
        "WANDB_CONFIG_DIR": str(home / "config"),
        "WANDB_CACHE_DIR": str(home / "cache"),
        "WANDB_DATA_DIR": str(home / "data"),
        "WANDB_DIR": str(home / "dir"),
        "MLFLOW_ALLOW_FILE_STORE": "true",
    }.items():
        monkeypatch.setenv(name, value)
    for name in ("WANDB_API_KEY", "WANDB_ENTITY", "WANDB_PROJECT", "WANDB_RUN_ID", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module", autouse=True)
def _stop_wandb_service() -> Iterator[None]:
    yield
    wandb.teardown()  # do not leave the wandb-core service process running for other test modules


# ------------------------------------------------------------------------------------------- helpers


def _wandb_records(path: Path) -> list[Any]:
    """Decodes a W&B ``.wandb`` transaction log (LevelDB-style 32 KiB blocks of protobuf records)."""
    raw, block, pos, pending, records = path.read_bytes(), 32768, 7, b"", []
    assert raw[:4] == b":W&B", raw[:7]
    while pos + 7 <= len(raw):
        if block - pos % block < 7:  # block trailer padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        if pos + 7 + length > len(raw):  # a record still being written
            break
        data, pos = raw[pos + 7 : pos + 7 + length], pos + 7 + length
        pending = data if kind in (1, 2) else pending + data  # FULL, FIRST | MIDDLE, LAST
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def _finished_wandb_run(run_file: Path, timeout_s: float = 120.0) -> list[Any]:
    """The records of an offline run, once its exit record is on disk.

    ``run.finish()`` returns before wandb-core has flushed the offline ``.wandb`` file (it is written by
    the service process), so wait for the exit record rather than reading straight away.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        records = _wandb_records(run_file)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.02)


def _wandb_run_files(log_dir: Path) -> list[Path]:
    return sorted((log_dir / "wandb" / "wandb").glob("offline-run-*/run-*.wandb"))


def _wandb_history(records: list[Any]) -> dict[int, dict[str, Any]]:
    history: dict[int, dict[str, Any]] = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            history[record.history.step.num] = {k: v for k, v in items.items() if not k.startswith("_")}
    return history


def _wandb_run_record(records: list[Any]) -> Any:
    return next(r.run for r in records if r.WhichOneof("record_type") == "run")


def _wandb_config(records: list[Any]) -> dict[str, Any]:
    return {u.key: json.loads(u.value_json) for u in _wandb_run_record(records).config.update}


def _wandb_exit_code(records: list[Any]) -> int:
    return next(r.exit.exit_code for r in records if r.WhichOneof("record_type") == "exit")


def _mlflow_client(log_dir: Path) -> MlflowClient:
    return MlflowClient(tracking_uri=(log_dir / "mlruns").resolve().as_uri())


def _history(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


# --------------------------------------------------------------------------------------------- W&B


def test_wandb_offline_run_under_log_dir_holds_steps_config_and_finishes(tmp_path: Path) -> None:
    with MetricsLogger(
        tmp_path, tensorboard_enabled=False, run_config=RUN_CONFIG, wandb=WandbConfig()
    ) as log:
        backend = log.backends[-1]
        assert isinstance(backend, WandbBackend)
        for step in range(1, 4):
            log.log(step, {"train/reward": step / 10, "val:accuracy": 1, "train/kl": math.nan})
    run_id = (tmp_path / "wandb_run_id.txt").read_text(encoding="utf-8").strip()
    assert run_id == backend.run_id
    [run_file] = _wandb_run_files(tmp_path)
    assert run_file.name == f"run-{run_id}.wandb"
    records = _finished_wandb_run(run_file)
    history = _wandb_history(records)
    assert history == {s: {"train/reward": s / 10, "val:accuracy": 1} for s in (1, 2, 3)}  # NaN skipped
    run = _wandb_run_record(records)
    assert run.run_id == run_id and run.project == "rlfleet"
    config = _wandb_config(records)
    assert config["policy"] == RUN_CONFIG["policy"] and config["grpo"]["lr"] == 1e-5
    assert _wandb_exit_code(records) == 0


def test_wandb_resume_reuses_run_id_and_failure_sets_exit_code(tmp_path: Path) -> None:
    cfg = WandbConfig(name="demo", dir=str(tmp_path / "wb"))
    with MetricsLogger(tmp_path, tensorboard_enabled=False, wandb=cfg) as log:
        log.log(1, {"train/reward": 0.1})
    with (
        pytest.raises(RuntimeError, match="boom"),
        MetricsLogger(tmp_path, tensorboard_enabled=False, wandb=cfg) as log,
    ):
        log.truncate_after(1)
        log.log(2, {"train/reward": 0.2})
        raise RuntimeError("boom")
    first_file, second_file = sorted((tmp_path / "wb" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert first_file.name == second_file.name  # same W&B run id, two offline segments for `wandb sync`
    first, second = _finished_wandb_run(first_file), _finished_wandb_run(second_file)
    assert _wandb_run_record(first).display_name == "demo"
    assert _wandb_history(second) == {2: {"train/reward": 0.2}}
    assert (_wandb_exit_code(first), _wandb_exit_code(second)) == (0, 1)


def test_wandb_skips_steps_a_resumed_run_would_drop(tmp_path: Path) -> None:
    backend = WandbBackend(WandbConfig(), tmp_path, None)
    backend.min_step = 3  # as if W&B reported the resumed run's starting_step
    backend.log(2, {"train/reward": 0.2})
    backend.log(3, {"train/reward": 0.3})
    backend.log(4, {"train/kl": None})  # nothing to log
    backend.close()
    [run_file] = _wandb_run_files(tmp_path)
    assert _wandb_history(_finished_wandb_run(run_file)) == {3: {"train/reward": 0.3}}


# ------------------------------------------------------------------------------------------ MLflow


def test_mlflow_local_store_metrics_params_and_status(tmp_path: Path) -> None:
    with MetricsLogger(
        tmp_path, tensorboard_enabled=False, run_config=RUN_CONFIG, mlflow=MlflowConfig(run_name="r1")
    ) as log:
        backend = log.backends[-1]
        assert isinstance(backend, MlflowBackend) and backend.tracking_uri.startswith("file://")
        for step in range(1, 4):
            log.log(step, {"train/reward": step / 10, "val:accuracy": step, "train/kl": math.inf})
    run_id = (tmp_path / "mlflow_run_id.txt").read_text(encoding="utf-8").strip()
    client = _mlflow_client(tmp_path)
    run = client.get_run(run_id)
    assert run.info.run_name == "r1" and run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "rlfleet"
    assert _history(client, run_id, "train/reward") == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert _history(client, run_id, "val_accuracy") == [(1, 1.0), (2, 2.0), (3, 3.0)]
    assert "train/kl" not in run.data.metrics  # non-finite values are skipped
    params = run.data.params
    assert params["policy.model_name"] == "tiny-model" and params["policy.tokenizer.name"] == "tiny-tok"
    assert params["grpo.lr"] == "1e-05" and params["grpo.ops"] == '["+", "-"]'
    assert params["grpo.enabled"] == "true" and params["grpo.unset"] == "null"


def test_mlflow_resume_reuses_run_truncate_tags_and_relogs(tmp_path: Path) -> None:
    cfg = MlflowConfig(experiment_name="exp-a")
    with MetricsLogger(tmp_path, tensorboard_enabled=False, run_config={"lr": 1, "a": 1}, mlflow=cfg) as log:
        for step in (1, 2, 3):
            log.log(step, {"train/reward": float(step)})
        first_id = log.backends[-1].run_id
    with (
        pytest.raises(RuntimeError, match="boom"),
        MetricsLogger(tmp_path, tensorboard_enabled=False, run_config={"lr": 2, "b": 2}, mlflow=cfg) as log,
    ):
        backend = log.backends[-1]
        assert backend.run_id == first_id and backend.resumed
        log.truncate_after(2)
        log.log(3, {"train/reward": 30.0})
        raise RuntimeError("boom")
    run = _mlflow_client(tmp_path).get_run(first_id)
    assert run.info.status == "FAILED" and run.data.tags["rlfleet.resumed_from_step"] == "2"
    assert run.data.params == {"lr": "1", "a": "1", "b": "2"}  # params are immutable; new keys are added
    assert _history(_mlflow_client(tmp_path), first_id, "train/reward") == [
        (1, 1.0),
        (2, 2.0),
        (3, 3.0),
        (3, 30.0),
    ]


def test_mlflow_uri_from_config_or_env_and_stale_run_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = tmp_path / "store"
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "mlflow_run_id.txt").write_text("0123456789abcdef\n", encoding="utf-8")  # not in store
    backend = MlflowBackend(MlflowConfig(tracking_uri=store.as_uri()), tmp_path / "a", None)
    backend.log(1, {"x": 1.0})
    backend.close()
    assert not backend.resumed and backend.run_id != "0123456789abcdef"
    assert (tmp_path / "a" / "mlflow_run_id.txt").read_text(encoding="utf-8").strip() == backend.run_id
    assert _history(MlflowClient(tracking_uri=store.as_uri()), backend.run_id, "x") == [(1, 1.0)]
    assert not (tmp_path / "a" / "mlruns").exists()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store.as_uri())
    env_backend = MlflowBackend(MlflowConfig(), tmp_path / "b", None)
    env_backend.close()
    assert env_backend.tracking_uri == store.as_uri() and not (tmp_path / "b" / "mlruns").exists()


def test_mlflow_default_store_opts_in_to_file_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")  # MLflow 3.x refuses file stores without it
    MlflowBackend(MlflowConfig(), tmp_path, None).close()
    assert (tmp_path / "mlruns").is_dir()


def test_mlflow_names_and_params_respect_limits() -> None:
    assert mlflow_metric_name("train/reward") == "train/reward"
    assert mlflow_metric_name("val:accuracy") == "val_accuracy"
    assert mlflow_metric_name("/a//b/./c/../d€/") == "a/b/c/d_"
    assert mlflow_metric_name("") == "_"
    params = mlflow_params({"k": "x" * 10_000, "nested": {"deep": {"leaf": 1.5}, "empty": {}}}, value_max=500)
    assert len(params["k"]) == 500 and params["k"].endswith("...")
    assert params["nested.deep.leaf"] == "1.5" and params["nested.empty"] == "{}"


# ------------------------------------------------------------------------------- errors and config


@pytest.mark.parametrize(
    ("module", "kwargs"), [("wandb", {"wandb": WandbConfig()}), ("mlflow", {"mlflow": MlflowConfig()})]
)
def test_missing_package_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module: str, kwargs: dict[str, Any]
) -> None:
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(MetricsBackendError, match=rf"pip install 'rlfleet\[{module}\]'") as info:
        MetricsLogger(tmp_path, tensorboard_enabled=False, **kwargs)
    assert isinstance(info.value, ConfigError)  # the CLI reports it as a configuration error (exit 2)
    assert f"logger.{module}_enabled" in str(info.value)


def test_started_backends_are_closed_when_a_later_one_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(MetricsBackendError, match="mlflow"):
        MetricsLogger(tmp_path, tensorboard_enabled=False, wandb=WandbConfig(), mlflow=MlflowConfig())
    [run_file] = _wandb_run_files(tmp_path)
    assert _wandb_exit_code(_finished_wandb_run(run_file)) == 1


def test_wandb_init_failure_says_how_to_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(**kwargs: Any) -> None:
        raise wandb.errors.UsageError("api_key not configured (no-tty)")

    monkeypatch.setattr(wandb, "init", refuse)
    with pytest.raises(MetricsBackendError, match=r"api_key not configured.*WANDB_API_KEY.*mode=offline"):
        WandbBackend(WandbConfig(mode="online"), tmp_path, None)


def test_mlflow_init_failure_masks_url_credentials(tmp_path: Path) -> None:
    with pytest.raises(MetricsBackendError, match=r"logger\.mlflow\.tracking_uri") as info:
        MlflowBackend(MlflowConfig(tracking_uri="bogus://alice:pw-secret@host"), tmp_path, None)
    assert "pw-secret" not in str(info.value) and "bogus://***@host" in str(info.value)
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_mlflow_deleted_experiment_is_refused(tmp_path: Path) -> None:
    client = _mlflow_client(tmp_path)
    client.delete_experiment(client.create_experiment("gone"))
    with pytest.raises(MetricsBackendError, match=r"experiment 'gone' .* is deleted"):
        MlflowBackend(MlflowConfig(experiment_name="gone"), tmp_path, None)


def test_mlflow_log_failure_warns_once_and_training_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from mlflow.exceptions import MlflowException

    backend = MlflowBackend(MlflowConfig(), tmp_path, None)

    def fail(*args: Any, **kwargs: Any) -> None:
        raise MlflowException("server unavailable")

    monkeypatch.setattr(backend.client, "log_batch", fail)
    with caplog.at_level("WARNING", logger="rlfleet.logging.backends"):
        backend.log(1, {"x": 1.0})
        backend.log(2, {"x": 2.0})
    assert [r.getMessage().count("server unavailable") for r in caplog.records] == [1]
    backend.close()


def test_from_config_maps_logger_section(tmp_path: Path) -> None:
    cfg = LoggerConfig(
        log_dir=str(tmp_path / "logs"),
        tensorboard_enabled=True,
        tensorboard={"log_dir": str(tmp_path / "tb")},
        wandb_enabled=True,
        mlflow_enabled=True,
        mlflow={"experiment_name": "from-config"},
    )
    with MetricsLogger.from_config(cfg, {"seed": 1}) as log:
        kinds = [type(b).__name__ for b in log.backends]
        assert kinds == ["JsonlBackend", "TensorboardBackend", "WandbBackend", "MlflowBackend"]
        log.log(1, {"train/reward": 1.0})
    assert (tmp_path / "tb").is_dir() and _wandb_run_files(tmp_path / "logs")
    run_id = (tmp_path / "logs" / "mlflow_run_id.txt").read_text(encoding="utf-8").strip()
    run = _mlflow_client(tmp_path / "logs").get_run(run_id)
    assert run.data.params == {"seed": "1"}
    plain = MetricsLogger.from_config(
        LoggerConfig(log_dir=str(tmp_path / "p"), tensorboard_enabled=False), None
    )
    assert [type(b) for b in plain.backends] == [JsonlBackend]
    plain.close()


def test_wandb_and_mlflow_are_runnable_settings() -> None:
    ensure_runnable(MasterConfig(logger=LoggerConfig(wandb_enabled=True, mlflow_enabled=True)))


# ----------------------------------------------------------------------------------------- secrets


def test_looks_secret_and_scrub() -> None:
    secret = ["hf_token", "HF_TOKEN", "WANDB_API_KEY", "apiKey", "api-key", "key", "token", "db_password"]
    secret += [
        "client-secret",
        "aws_secret_access_key",
        "MLFLOW_TRACKING_TOKEN",
        "private_key",
        "accessToken",
    ]
    for name in secret:
        assert looks_secret(name), name
    for name in ("tokenizer", "pad_token", "input_key", "keep_top_k", "model_name", "monkey", "", "_"):
        assert not looks_secret(name), name
    # No setting of the schema is mistaken for a secret (token_level_loss, num_key_value_heads, ...).
    assert [key for key in schema_keys() if any(looks_secret(part) for part in key.split("."))] == []
    scrubbed = scrub_secrets(
        {"a": {"hf_token": "hf_abc", "api_key": None, "tokenizer": {"name": "t"}}, "uri": "https://u:p@h/x"}
    )
    assert scrubbed == {
        "a": {"hf_token": "***", "api_key": None, "tokenizer": {"name": "t"}},
        "uri": "https://***@h/x",
    }


def test_secrets_never_reach_files_under_log_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_API_KEY", "secret-xyz")
    monkeypatch.setenv("HF_TOKEN", "secret-hf")
    run_config = {
        **RUN_CONFIG,
        "hub": {"HF_TOKEN": "secret-cfg", "url": "https://bob:secret-url@example.com/repo"},
    }
    with MetricsLogger(
        tmp_path, tensorboard_enabled=True, run_config=run_config, wandb=WandbConfig(), mlflow=MlflowConfig()
    ) as log:
        log.log(1, {"train/reward": 0.5})
    [run_file] = _wandb_run_files(tmp_path)
    wandb_records = _finished_wandb_run(run_file)  # all of W&B's files are on disk
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(files) > 10  # jsonl, run config, TensorBoard, W&B offline run, MLflow store
    for path in files:
        data = path.read_bytes()
        for secret in (b"secret-xyz", b"secret-hf", b"secret-cfg", b"secret-url"):
            assert secret not in data, f"{secret!r} leaked into {path}"
    saved = json.loads((tmp_path / "run_config.json").read_text(encoding="utf-8"))
    assert saved["hub"]["HF_TOKEN"] == "***" and saved["policy"]["model_name"] == "tiny-model"
    params = _mlflow_client(tmp_path).get_run(log.backends[-1].run_id).data.params
    assert params["hub.HF_TOKEN"] == "***" and params["hub.url"] == "https://***@example.com/repo"
    wandb_config = _wandb_config(wandb_records)
    assert wandb_config["hub"]["HF_TOKEN"] == "***" and wandb_config["policy"]["model_name"] == "tiny-model"
