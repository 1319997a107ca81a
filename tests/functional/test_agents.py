"""Agents from outside: the OpenAI-compatible endpoint, with the real ``openai`` client, and the ``agent``
environment, whose episodes train on exactly the tokens the endpoint sampled."""

from __future__ import annotations

import re
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlfleet.algorithms.grpo.loop import GRPO
from rlfleet.data import Example, Prompt, build_prompts
from rlfleet.environments.runner import InProcessRunner, build_environment
from rlfleet.errors import UserError
from rlfleet.generation import GenerationResult, HFGenerationBackend, SamplingParams
from rlfleet.logging import read_metrics
from rlfleet.rollouts.episodes import EpisodeRunner
from rlfleet.serving.engine import PolicyEndpoint, ServingLimits
from rlfleet.serving.server import ServerSettings, ServerThread, check_settings
from tests.conftest import ROOT, _signals_as_in_a_terminal, cli_argv, cli_env, small_grpo_config
from tests.functional import agents_for_tests
from tests.functional.agents_for_tests import SEEN

AGENTS = "tests.functional.agents_for_tests"


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model_dir: Path) -> tuple[Any, Any]:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir), AutoTokenizer.from_pretrained(tiny_model_dir)


class Scripted:
    """A backend that answers every prompt with the next of ``replies`` (its text, one id per character)."""

    def __init__(self, replies: Sequence[str]) -> None:
        self.replies, self.calls = list(replies), []

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, seed: int) -> Any:
        raise AssertionError("the endpoint samples with generate_rows")

    def generate_rows(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int]
    ) -> list[GenerationResult]:
        self.calls.append((list(prompts), params, list(seeds)))
        out = []
        for _ in prompts:
            text = self.replies.pop(0)
            ids = tuple(range(5, 5 + len(text)))
            out.append(GenerationResult(ids, tuple(-0.5 for _ in ids), text, True))
        return out

    def refit(self) -> None: ...

    def take_metrics(self) -> dict[str, float]:
        return {}


@pytest.fixture
def scripted_server(model_and_tokenizer: tuple[Any, Any]) -> Iterator[tuple[Scripted, ServerThread]]:
    _, tokenizer = model_and_tokenizer
    backend = Scripted([])
    endpoint = PolicyEndpoint(backend, tokenizer, "policy", ServingLimits(max_seq_len=256, max_new_tokens=32))
    server = ServerThread(endpoint, ServerSettings(max_request_bytes=20_000))
    yield backend, server
    server.close()
    endpoint.close()


CALC = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluates an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}


def test_the_openai_client_gets_tool_calls_logprobs_and_openai_errors(
    scripted_server: tuple[Scripted, ServerThread],
) -> None:
    backend, server = scripted_server
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)
    assert [m.id for m in client.models.list()] == ["policy"]

    backend.replies = [
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*3"}}\n</tool_call>'
    ]
    messages: list[Any] = [{"role": "user", "content": "What is 12*3?"}]
    reply = client.chat.completions.create(model="policy", messages=messages, tools=[CALC], logprobs=True)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "calculator" and call.function.arguments == '{"expression": "12*3"}'
    assert choice.logprobs is not None and len(choice.logprobs.content or []) == reply.usage.completion_tokens
    assert all(t.logprob == -0.5 for t in choice.logprobs.content or [])
    params = backend.calls[-1][1]
    assert params.stop_strings == ("</tool_call>",)  # a turn with tools ends after its call

    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "36"},
    ]
    backend.replies = ["#### 36"]
    final = client.chat.completions.create(
        model="policy", messages=messages, tools=[CALC], temperature=0, seed=3
    )
    assert final.choices[0].message.content == "#### 36" and final.choices[0].finish_reason == "stop"
    # temperature 0: the most likely token, with its logprob reported (top-k 1 from the full distribution)
    assert backend.calls[-1][1].top_k == 1 and not backend.calls[-1][1].greedy

    backend.replies = ["7", "8"]
    completion = client.completions.create(model="policy", prompt="1 + 6 =", max_tokens=4, n=2, logprobs=0)
    assert [c.text for c in completion.choices] == ["7", "8"]
    assert completion.choices[0].logprobs.token_logprobs == [-0.5]

    errors = {
        "unknown model": (lambda: client.chat.completions.create(model="gpt-4", messages=messages), 404),
        "bad role": (
            lambda: client.chat.completions.create(
                model="policy", messages=[{"role": "bot", "content": "x"}]
            ),
            400,
        ),
        "too long": (
            lambda: client.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "9" * 1500}]
            ),
            400,
        ),
        "too many tokens": (
            lambda: client.chat.completions.create(model="policy", messages=messages[:1], max_tokens=10_000),
            400,
        ),
        "stream": (
            lambda: client.chat.completions.create(model="policy", messages=messages[:1], stream=True),
            400,
        ),
        "episode on a plain server": (
            lambda: openai.OpenAI(
                base_url=f"{server.base_url}/episodes/nope/v1", api_key="x", max_retries=0
            ).chat.completions.create(model="policy", messages=messages[:1]),
            404,
        ),
    }
    for name, (call_it, status) in errors.items():
        with pytest.raises(openai.APIStatusError) as caught:
            call_it()
        assert caught.value.status_code == status, name
        body = caught.value.body
        assert isinstance(body, dict) and body["message"] and body["type"], name  # an OpenAI error body
        assert "Traceback" not in body["message"], name

    big = httpx.post(
        f"{server.base_url}/v1/completions",
        content=b"x" * 30_000,
        headers={"content-type": "application/json"},
    )
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    bad = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert bad.status_code == 400 and "invalid request" in bad.json()["error"]["message"]
    missing = httpx.post(f"{server.base_url}/v1/chat/completions", json={"model": "policy"})
    assert missing.status_code == 400 and "messages" in missing.json()["error"]["message"]


def test_a_server_reachable_from_outside_needs_a_key(model_and_tokenizer: tuple[Any, Any]) -> None:
    with pytest.raises(UserError, match="without an API key"):
        check_settings(ServerSettings(host="0.0.0.0"))
    check_settings(ServerSettings(host="::1"))
    _, tokenizer = model_and_tokenizer
    endpoint = PolicyEndpoint(Scripted(["ok"]), tokenizer, "policy", ServingLimits(256, 16))
    server = ServerThread(endpoint, ServerSettings(api_key="s3cret"))
    try:
        anonymous = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            anonymous.models.list()
        keyed = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="s3cret", max_retries=0)
        assert [m.id for m in keyed.models.list()] == ["policy"]
        assert httpx.get(f"{server.base_url}/health").status_code == 200
    finally:
        server.close()
        endpoint.close()


# --------------------------------------------------------------------------------------- agent episodes


def agent_runner(backend: Any, tokenizer: Any, fn: str, **settings: Any) -> EpisodeRunner:
    env = build_environment("agent", {"agent_fn": f"{AGENTS}:{fn}", **settings})
    return EpisodeRunner(backend, tokenizer, {"agent": InProcessRunner("agent", env)}, "agent", 1, 256)


def prompts(tokenizer: Any, golds: Sequence[str]) -> list[Prompt]:
    examples = [Example(f"What is {i} + {i}?", "", gold) for i, gold in enumerate(golds)]
    return build_prompts(tokenizer, examples, system_prompt=None, max_prompt_tokens=None)[0]


@pytest.mark.parametrize("fn", ["two_turns", "two_turns_async"])
def test_agent_episodes_train_on_exactly_the_tokens_the_endpoint_sampled(
    model_and_tokenizer: tuple[Any, Any], fn: str
) -> None:
    model, tokenizer = model_and_tokenizer
    SEEN.clear()
    runner = agent_runner(
        HFGenerationBackend(model, tokenizer, batch_size=16), tokenizer, fn, max_concurrency=3
    )
    try:
        batch = runner.run(
            prompts(tokenizer, ["1", "2", "3", "4"]), 1, SamplingParams(max_new_tokens=10), seed=5
        )
    finally:
        runner.environments["agent"].close()
    assert batch.num_errors == 0 and batch.num_timeouts == 0
    assert batch.metrics["agent/requests_per_episode"] == 2.0 and batch.metrics["agent/history_edits"] == 0.0
    assert batch.metrics["turns_per_episode"] == 2.0
    for rollout in batch.rollouts:
        first, second = SEEN[rollout.prompt.example.question]
        assert list(rollout.prompt.token_ids) == first["prompt_token_ids"]  # the agent's first prompt
        # the training sequence is the last request's prompt and sample, token for token
        assert [*rollout.prompt.token_ids, *rollout.result.token_ids] == second["prompt_token_ids"] + second[
            "token_ids"
        ]
        # the trained positions are exactly the sampled tokens, with the logprobs the client was sent
        assert rollout.mask is not None
        sampled = [t for t, m in zip(rollout.result.token_ids, rollout.mask, strict=True) if m]
        assert sampled == first["token_ids"] + second["token_ids"]
        kept = [lp for lp, m in zip(rollout.result.logprobs, rollout.mask, strict=True) if m]
        assert kept == pytest.approx(first["logprobs"] + second["logprobs"])
        assert rollout.info is not None and rollout.info["turns"] == 2.0
        assert 0.0 <= rollout.reward <= 1.0


def test_an_agent_that_rewrites_its_history_trains_on_its_last_segment(
    model_and_tokenizer: tuple[Any, Any],
) -> None:
    model, tokenizer = model_and_tokenizer
    SEEN.clear()
    runner = agent_runner(HFGenerationBackend(model, tokenizer, batch_size=8), tokenizer, "forgetful")
    try:
        batch = runner.run(prompts(tokenizer, ["4"]), 1, SamplingParams(max_new_tokens=8), seed=1)
    finally:
        runner.environments["agent"].close()
    (rollout,) = batch.rollouts
    first, second = next(iter(SEEN.values()))
    assert batch.metrics["agent/history_edits"] == 1.0
    assert batch.metrics["agent/dropped_tokens"] == len(first["token_ids"])
    assert list(rollout.prompt.token_ids) == second["prompt_token_ids"]
    assert list(rollout.result.token_ids) == second["token_ids"] and rollout.reward == 0.5


def test_a_failing_or_hanging_agent_costs_its_episode_only(model_and_tokenizer: tuple[Any, Any]) -> None:
    model, tokenizer = model_and_tokenizer
    SEEN.clear()
    runner = agent_runner(
        HFGenerationBackend(model, tokenizer, batch_size=8), tokenizer, "misbehaving", timeout_s=1.5
    )
    try:
        batch = runner.run(
            prompts(tokenizer, ["1", "2", "3", "4"]), 1, SamplingParams(max_new_tokens=6), seed=2
        )
        rewards = [r.reward for r in batch.rollouts]
        assert rewards == [0.0, 0.0, 0.0, 0.25]
        assert batch.num_errors == 2 and batch.num_timeouts == 1
        assert [r.info["env_failed"] for r in batch.rollouts if r.info] == [1.0, 1.0, 1.0, 0.0]
        for _ in range(200):  # the hanging agent wakes up and tries again: its episode is closed
            if "late" in SEEN:
                break
            time.sleep(0.05)
        assert "late" in SEEN and "closed" in SEEN["late"][0]["error"]
    finally:
        runner.environments["agent"].close()


def test_the_calculator_agent_samples_what_the_tools_environment_samples(
    model_and_tokenizer: tuple[Any, Any],
) -> None:
    """The shipped OpenAI-API agent and the ``tools`` environment's turn loop, same rows and seed: the same
    prompts (rendered with the calculator's schema), stop strings and per-turn seeds, so the same tokens and
    rewards."""
    model, tokenizer = model_and_tokenizer
    backend = HFGenerationBackend(model, tokenizer, batch_size=16)
    tools_env = build_environment("tools", {"tools": ["calculator"], "max_tool_calls": 2})
    examples = [Example(f"What is {a} * {b}?", "", str(a * b)) for a, b in [(12, 34), (56, 7), (8, 90)]]
    rows = build_prompts(
        tokenizer, examples, system_prompt=None, max_prompt_tokens=None, tools=tools_env.tools
    )[0]
    params = SamplingParams(max_new_tokens=24)
    loop = EpisodeRunner(backend, tokenizer, {"tools": InProcessRunner("tools", tools_env)}, "tools", 3, 256)
    expected = loop.run(rows, 2, params, seed=11).rollouts
    agent = build_environment("agent", {"agent_fn": "rlfleet.examples.calculator_agent:run"})
    runner = EpisodeRunner(backend, tokenizer, {"agent": InProcessRunner("agent", agent)}, "agent", 3, 256)
    try:
        played = runner.run(rows, 2, params, seed=11).rollouts
    finally:
        agent.close()
    for mine, theirs in zip(played, expected, strict=True):
        assert mine.prompt.token_ids == theirs.prompt.token_ids
        assert mine.result.token_ids == theirs.result.token_ids and mine.mask == theirs.mask
        assert mine.result.logprobs == pytest.approx(theirs.result.logprobs)
        assert mine.reward == theirs.reward


def test_the_readme_agent_runs_from_its_file(model_and_tokenizer: tuple[Any, Any], tmp_path: Path) -> None:
    """The README's 20-line agent, saved as a file and named by path (``file.py:run``), plays episodes."""
    readme = (ROOT / "README.md").read_text()
    code = readme.split("<!-- agent-example -->\n```python\n", 1)[1].split("```", 1)[0]
    assert len(code.strip().splitlines()) <= 20
    (tmp_path / "my_agent.py").write_text(code)
    model, tokenizer = model_and_tokenizer
    backend = HFGenerationBackend(model, tokenizer, batch_size=8)
    env = build_environment("agent", {"agent_fn": f"{tmp_path / 'my_agent.py'}:run"})
    runner = EpisodeRunner(backend, tokenizer, {"agent": InProcessRunner("agent", env)}, "agent", 3, 256)
    try:
        batch = runner.run(prompts(tokenizer, ["6", "8"]), 2, SamplingParams(max_new_tokens=8), seed=3)
    finally:
        env.close()
    assert batch.num_errors == 0 and batch.num_timeouts == 0 and len(batch.rollouts) == 4
    assert all(r.info is not None and r.info["turns"] >= 1 for r in batch.rollouts)


def test_a_bad_agent_path_fails_before_anything_runs() -> None:
    for spec in ["tests.functional.agents_for_tests:nope", "", "no_colon", "missing/file.py:run"]:
        with pytest.raises(UserError, match="agent_fn"):
            build_environment("agent", {"agent_fn": spec})
    with pytest.raises(UserError, match=r"task, client, model"):
        build_environment("agent", {"agent_fn": f"{AGENTS}:_keep"})  # two parameters
    assert agents_for_tests.two_turns  # the module the recipe names is importable


def test_grpo_trains_an_openai_api_agent_and_rlfleet_serve_serves_the_checkpoint(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Two GRPO steps on episodes an OpenAI-API agent plays (two requests each): the trainer scores the
    recorded tokens as the engine sampled them, and the update moves the policy. Then ``rlfleet serve``
    serves the checkpoint to the OpenAI client (greedy: the same reply twice) and stops on Ctrl-C."""
    cfg = small_grpo_config(
        tiny_model_dir,
        tmp_path,
        "grpo.max_num_steps=2",
        "grpo.val_period=2",
        "data.env_name=agent",
        f"env.agent.agent_fn={AGENTS}:two_turns",
        "policy.precision=float32",
    )
    GRPO(cfg).train()
    records = read_metrics(tmp_path / "logs")
    steps = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for record in steps:
        assert record["train/agent/requests_per_episode"] == 2.0
        assert record["train/gen_logprob_error"] < 1e-4
        assert record["train/grad_norm"] > 0
    assert records[-1]["val/agent/requests_per_episode"] == 2.0

    # rlfleet serve: the trained checkpoint behind the endpoint, until Ctrl-C
    checkpoint = tmp_path / "ckpt" / "step_2"
    server = subprocess.Popen(
        cli_argv("serve", str(checkpoint), f"logger.log_dir={tmp_path / 'serve'}", "--port", "0"),
        cwd=ROOT,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_signals_as_in_a_terminal,
    )
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        url = re.search(r"at (http://\S+/v1)", line)
        assert url, line + (server.stderr.read() if server.stderr and server.poll() is not None else "")
        assert "curl " in server.stdout.readline()
        client = openai.OpenAI(base_url=url.group(1), api_key="none", max_retries=0)
        question = [{"role": "user", "content": "What is 2 + 3?"}]
        replies = [
            client.chat.completions.create(model="policy", messages=question, temperature=0, max_tokens=8)
            for _ in range(2)
        ]
        assert replies[0].choices[0].message.content == replies[1].choices[0].message.content  # greedy
        assert replies[0].usage.completion_tokens == len(replies[0].choices[0].token_ids) > 0
    finally:
        server.send_signal(signal.SIGINT)
        _, stderr = server.communicate(timeout=60)
    assert server.returncode == 0 and "server stopped" in stderr, stderr[-2000:]
