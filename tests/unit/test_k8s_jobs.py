"""Ray Jobs API helpers that need no cluster: auth header resolution, addresses, ids, env checks."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from rlfleet.deploy.jobs import (
    JobsApiError,
    auth_headers,
    normalize_address,
    submission_id_for,
    submit_recipe,
)


def test_no_auth_mode_sends_no_token(tmp_path: Path) -> None:
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("file-token\n")
    assert auth_headers({}, home=tmp_path) == {}  # like Ray: the token is sent only with RAY_AUTH_MODE=token
    assert auth_headers({"RAY_AUTH_MODE": "disabled", "RAY_AUTH_TOKEN": "x"}, home=tmp_path) == {}


def test_token_sources_in_ray_order(tmp_path: Path) -> None:
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("file-token\n")
    path_file = tmp_path / "tok"
    path_file.write_text(" path-token ")
    mode = {"RAY_AUTH_MODE": "token"}
    assert auth_headers({**mode}, home=tmp_path) == {"Authorization": "Bearer file-token"}
    env = {**mode, "RAY_AUTH_TOKEN_PATH": str(path_file)}
    assert auth_headers(env, home=tmp_path) == {"Authorization": "Bearer path-token"}
    env["RAY_AUTH_TOKEN"] = "env-token"
    assert auth_headers(env, home=tmp_path) == {"Authorization": "Bearer env-token"}


def test_missing_or_bad_token_configuration_says_what_to_set(tmp_path: Path) -> None:
    with pytest.raises(JobsApiError, match="set RAY_AUTH_TOKEN, or RAY_AUTH_TOKEN_PATH"):
        auth_headers({"RAY_AUTH_MODE": "token"}, home=tmp_path)
    with pytest.raises(JobsApiError, match="cannot read"):
        auth_headers({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(tmp_path / "nope")}, home=tmp_path)
    with pytest.raises(JobsApiError, match="not a Ray auth mode"):
        auth_headers({"RAY_AUTH_MODE": "k8s"}, home=tmp_path)


def test_addresses() -> None:
    assert normalize_address("127.0.0.1:8265", {}) == "http://127.0.0.1:8265"
    assert normalize_address(None, {"RAY_ADDRESS": "https://ray.example/"}) == "https://ray.example"
    with pytest.raises(JobsApiError, match="port-forward"):
        normalize_address(None, {})
    with pytest.raises(JobsApiError, match="dashboard's http"):
        normalize_address("ray://10.0.0.1:10001", {})


def test_submission_ids() -> None:
    now = datetime(2026, 11, 30, 12, 34, 56, tzinfo=UTC)
    assert (
        submission_id_for("grpo-qwen2.5-0.5b-gsm8k-1n1g.yaml", now)
        == "rlfleet-grpo-qwen2-5-0-5b-gsm8k-1n1g-20261130-123456"
    )


def test_secrets_never_go_into_a_runtime_env() -> None:
    with pytest.raises(JobsApiError, match="secrets must not travel"):
        submit_recipe("http://127.0.0.1:9", "grpo-tiny-arithmetic-cpu", env_vars={"HF_TOKEN": "x"})
