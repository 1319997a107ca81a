"""The environment interface and the built-in environments: NeMo RL's cases, the tool and code environments,
return validation, loading by import path, and the config keys that name environments."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from rlfleet.config import ConfigError, MasterConfig, check_config
from rlfleet.data import DataError, load_task
from rlfleet.data.arithmetic import tool_transcript
from rlfleet.data.prompts import ObservationTemplate
from rlfleet.environments import (
    CodeEnvironment,
    EnvironmentLoadError,
    EnvironmentReturn,
    MathEnvironment,
    ToolEnvironment,
    build_environment,
    environment_class,
    load_humaneval,
)
from rlfleet.environments.builtin import extract_code
from rlfleet.environments.interface import MalformedReturn, split_return
from rlfleet.models.tiny import CHAT_TEMPLATE, train_tokenizer
from rlfleet.policy.batch import collate


def convo(question: str, *answers: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}, *({"role": "assistant", "content": a} for a in answers)]


# ------------------------------------------------------------- math: ported from NeMo RL
# tests/unit/environments/test_math_environment.py: test_math_env_step_basic, test_math_env_step_mixed,
# test_math_env_step_multiple_assistant_messages


def test_math_env_step_basic() -> None:
    logs = [
        convo("What is 2 + 2?", "2 + 2 = \\boxed{4}"),
        convo("What is 3 * 4?", "3 * 4 = \\boxed{12}"),
        convo("What is 10 - 5?", "10 - 5 = \\boxed{5}"),
    ]
    metadata = [{"ground_truth": "4"}, {"ground_truth": "\\boxed{12}"}, {"ground_truth": "\\boxed{5}"}]
    result = MathEnvironment().step(logs, metadata)
    assert all(
        obs == {"role": "environment", "content": "Environment: correct"} for obs in result.observations
    )
    assert result.metadata == metadata
    assert isinstance(result.rewards, torch.Tensor) and result.rewards.shape == (3,)
    assert all(result.rewards == 1.0)
    assert isinstance(result.terminateds, torch.Tensor) and all(result.terminateds == 1.0)


def test_math_env_step_mixed() -> None:
    logs = [
        convo("What is 2 + 2?", "2 + 2 = \\boxed{\\frac{8}{2}}"),
        convo("What is 3 * 4?", "3 * 4 = 13"),
        convo("What is 10 - 5?", "10 - 5 = \\boxed{5}"),
    ]
    metadata = [{"ground_truth": "4.0"}, {"ground_truth": "\\boxed{12}"}, {"ground_truth": "\\boxed{5}"}]
    result = MathEnvironment().step(logs, metadata)
    assert [o["content"] for o in result.observations] == [
        "Environment: correct",
        "Environment: incorrect",
        "Environment: correct",
    ]
    assert torch.equal(torch.as_tensor(result.rewards), torch.tensor([1.0, 0.0, 1.0]))


def test_math_env_step_multiple_assistant_messages() -> None:
    logs = [
        convo("What is 2 + 2?", "Let me think...", "2 + 2 = \\boxed{4}"),
        convo("What is 3 * 4?", "I'll calculate that...", "3 * 4 = \\boxed{12}"),
    ]
    result = MathEnvironment().step(logs, [{"ground_truth": "4"}, {"ground_truth": "\\boxed{12}"}])
    assert all(torch.as_tensor(result.rewards) == 1.0)


# ---------------------------------------------------------------------------------------------- tools

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "123 * 456"}}</tool_call>'


def test_tool_env_answers_a_call_then_scores_the_answer() -> None:
    env = ToolEnvironment({"tools": ["calculator"]})
    meta = [{"ground_truth": "56088"}]
    first = split_return(env.step([convo("What is 123 * 456?", CALL)], meta), 1)[0]
    assert first.observation == {"role": "tool", "content": "56088"}
    assert not first.terminated and first.reward == 0.0 and first.stop_strings == ("</tool_call>",)
    assert first.metadata["tool_calls"] == 1 and first.metadata["tool_errors"] == 0
    log = [
        *convo("What is 123 * 456?", CALL),
        first.observation,
        {"role": "assistant", "content": "#### 56088"},
    ]
    final = split_return(env.step([log], [first.metadata]), 1)[0]
    assert final.terminated and final.reward == 1.0 and final.metadata["tool_calls"] == 1


@pytest.mark.parametrize(
    "message",
    [
        '<tool_call>{"name": "calculator", "arguments": {"expression": "1 +"}</tool_call>',  # bad JSON
        '<tool_call>{"name": "abacus", "arguments": {"expression": "1"}}</tool_call>',  # unknown tool
        '<tool_call>{"name": "calculator", "arguments": {"expr": "1"}}</tool_call>',  # wrong argument
        '<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}',  # never closed
        '<tool_call>{"name": "calculator", "arguments": {"expression": "1 / 0"}}</tool_call>',  # tool error
    ],
)
def test_a_malformed_call_is_an_observation_not_a_crash(message: str) -> None:
    env = ToolEnvironment({"tools": ["calculator"]})
    outcome = split_return(env.step([convo("q", message)], [{"ground_truth": "1"}]), 1)[0]
    assert not outcome.terminated and outcome.reward == 0.0
    assert outcome.observation["role"] == "tool" and "error" in outcome.observation["content"]
    assert outcome.metadata["tool_errors"] == 1


def test_tool_calls_beyond_the_budget_are_refused() -> None:
    env = ToolEnvironment({"tools": ["calculator"], "max_tool_calls": 1})
    outcome = split_return(env.step([convo("q", CALL)], [{"ground_truth": "1", "tool_calls": 1}]), 1)[0]
    assert "no more tool calls" in outcome.observation["content"] and outcome.metadata["tool_errors"] == 1


def test_the_python_tool_runs_in_the_sandbox() -> None:
    env = ToolEnvironment({"tools": ["python"]})
    call = '<tool_call>{"name": "python", "arguments": {"code": "print(6 * 7)"}}</tool_call>'
    outcome = split_return(env.step([convo("q", call)], [{"ground_truth": "42"}]), 1)[0]
    assert "42" in outcome.observation["content"] and outcome.metadata["tool_errors"] == 0


def test_unknown_tools_are_refused_when_built() -> None:
    with pytest.raises(EnvironmentLoadError, match="unknown tools"):
        build_environment("tools", {"tools": ["abacus"]})


# ----------------------------------------------------------------------------------------------- code


def test_code_env_scores_canonical_solutions_one_and_broken_ones_less() -> None:
    problems = load_humaneval()[:3]
    env = CodeEnvironment()
    whole = [p["prompt"] + p["canonical_solution"] for p in problems]
    logs = [convo("q", f"Here it is:\n```python\n{code}```\n") for code in whole]
    logs.append(convo("q", "```python\ndef nothing():\n    pass\n```"))
    metadata = [{"problem": p} for p in [*problems, problems[0]]]
    outcomes = split_return(env.step(logs, metadata), len(logs))
    assert [o.reward for o in outcomes[:3]] == [1.0, 1.0, 1.0]
    assert outcomes[3].reward < 1.0 and all(o.terminated for o in outcomes)


def test_code_env_without_terminate_on_evaluation_pays_improvements() -> None:
    problem = load_humaneval()[0]
    env = CodeEnvironment({"terminate_on_evaluation": False})
    wrong = convo("q", "```python\ndef has_close_elements(numbers, threshold):\n    return False\n```")
    first = split_return(env.step([wrong], [{"problem": problem}]), 1)[0]
    assert not first.terminated and "tests passed" in first.observation["content"]
    right = [
        *wrong,
        first.observation,
        {"role": "assistant", "content": problem["prompt"] + problem["canonical_solution"]},
    ]
    second = split_return(env.step([right], [first.metadata]), 1)[0]
    assert second.terminated and first.reward + second.reward == pytest.approx(1.0)


def test_extract_code_takes_the_first_fenced_block() -> None:
    assert extract_code("text\n```python\nx = 1\n```\nmore") == "x = 1\n"
    assert extract_code("```\ny = 2\n") == "y = 2\n"  # unclosed: to the end
    assert extract_code("    return 1\n") == "    return 1\n"  # a body continuing the prompt


# ------------------------------------------------------------------------------- returns and loading


def good_return(n: int = 2) -> EnvironmentReturn[Any]:
    return EnvironmentReturn(
        [{"role": "tool", "content": "x"}] * n, [{}] * n, [None] * n, torch.ones(n), torch.zeros(n), None
    )


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("rewards", [1.0], "one entry per episode"),
        ("rewards", [float("nan"), 1.0], "finite"),
        ("observations", ["text", "text"], "observation must be"),
        ("next_stop_strings", ["</x>", None], "list of non-empty strings"),
        ("terminateds", None, "one entry per episode"),
    ],
)
def test_malformed_returns_are_named(field: str, value: Any, message: str) -> None:
    with pytest.raises(MalformedReturn, match=message):
        split_return(good_return()._replace(**{field: value}), 2)


def test_a_valid_return_splits_per_episode() -> None:
    outcomes = split_return(good_return(), 2)
    assert [o.reward for o in outcomes] == [1.0, 1.0] and not outcomes[0].terminated
    with pytest.raises(MalformedReturn, match="EnvironmentReturn"):
        split_return({"rewards": 1}, 1)


def test_environment_classes_load_by_name_and_import_path() -> None:
    assert environment_class("math") is MathEnvironment
    assert environment_class("rlfleet.environments.builtin:CodeEnvironment") is CodeEnvironment
    assert environment_class("rlfleet.environments.builtin.ToolEnvironment") is ToolEnvironment
    for bad, message in [
        ("no_such_module:Env", "cannot import"),
        ("rlfleet.environments.builtin:Nope", "cannot import"),
        ("tests.functional.envs_for_tests:NotAnEnvironment", "not a subclass"),
        ("justaname", "not an import path"),
    ]:
        with pytest.raises(EnvironmentLoadError, match=message):
            environment_class(bad)


# ------------------------------------------------------------------------------------------ config


def test_an_unknown_default_environment_fails_validation() -> None:
    cfg = MasterConfig.model_validate({"policy": {"model_name": "m"}, "data": {"env_name": "chess"}})
    with pytest.raises(ConfigError, match=r"data\.env_name: 'chess' is not an environment"):
        check_config(cfg, "grpo")


def test_a_users_environment_is_configured_under_its_own_name() -> None:
    cfg = MasterConfig.model_validate(
        {"env": {"chess": {"environment": "pkg.mod:Chess", "num_workers": 2, "cfg": {"depth": 3}}}}
    )
    assert cfg.env.custom()["chess"].cfg == {"depth": 3}
    with pytest.raises(ValueError, match=r"env\.chess is not a built-in environment"):
        MasterConfig.model_validate({"env": {"chess": {"num_workers": 2}}})
    with pytest.raises(ValueError, match=r"did you mean env\.tools\?"):
        MasterConfig.model_validate({"env": {"tols": {"num_workers": 2}}})


def test_rows_name_their_environment(tmp_path: Any) -> None:
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        '{"question": "q", "answer": "#### 1", "task_name": "tools"}\n{"question": "r", "answer": "#### 2"}\n'
    )
    data = {"dataset_name": "ResponseDataset", "train_data_path": str(rows), "val_data_path": str(rows)}
    train, _ = load_task(MasterConfig.model_validate({"data": data}).data)
    assert [ex.env for ex in train] == ["tools", None]
    rows.write_text('{"question": "q", "answer": "#### 1", "task_name": 3}\n')
    with pytest.raises(DataError, match="task_name"):
        load_task(MasterConfig.model_validate({"data": data}).data)


# ----------------------------------------------------------------------------------- observations


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    return train_tokenizer(["user assistant tool system 0123456789 <tool_call> calculator"], 300)


def test_observations_render_with_the_chat_template() -> None:
    template = ObservationTemplate(tiny_tokenizer())
    tool = {"role": "tool", "content": "56088"}
    assert (
        template.text(tool, ended_with_eos=False)
        == "<|im_end|>\n<|im_start|>tool\n56088<|im_end|>\n<|im_start|>assistant\n"
    )
    assert (
        template.text(tool, ended_with_eos=True)
        == "\n<|im_start|>tool\n56088<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tiny_tokenizer().chat_template == CHAT_TEMPLATE


def test_the_sft_transcript_is_the_episode_grpo_samples() -> None:
    """The multiplication task's SFT target is exactly the call, the tools environment's rendered answer,
    and the final answer: SFT teaches the turns GRPO then samples."""
    template = ObservationTemplate(tiny_tokenizer())
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "123 * 456"}}</tool_call>'
    env = ToolEnvironment({"tools": ["calculator"]})
    observation = split_return(env.step([convo("q", call)], [{"ground_truth": "56088"}]), 1)[0].observation
    assert tool_transcript(123, 456) == call + template.text(observation, ended_with_eos=False) + "#### 56088"


def test_multiplication_task_splits_are_disjoint() -> None:
    data = MasterConfig.model_validate({"data": {"dataset_name": "multiplication"}}).data
    train, val = load_task(data)
    assert len(train) == 2048 and len(val) == 128
    assert not {ex.question for ex in train} & {ex.question for ex in val}
    a, b = (int(x) for x in val[0].question.removeprefix("What is ").removesuffix("?").split(" * "))
    assert val[0].gold == str(a * b) and 100 <= a < 10_000


def test_collate_masks_observation_tokens() -> None:
    batch = collate([[1, 2]], [[3, 4, 5, 6]], 0, [[-1.0, 0.0, 0.0, -2.0]], [[1, 0, 0, 1]])
    assert batch.response_mask.tolist() == [[0.0, 0.0, 1.0, 0.0, 0.0, 1.0]]
    with pytest.raises(ValueError, match="mask of 3"):
        collate([[1]], [[2, 3]], 0, None, [[1, 0, 1]])


def test_the_tools_environment_needs_a_second_turn() -> None:
    cfg = MasterConfig.model_validate({"policy": {"model_name": "m"}, "data": {"env_name": "tools"}})
    with pytest.raises(ConfigError, match="no call would ever get its result"):
        check_config(cfg, "grpo")
    three = cfg.grpo.model_copy(update={"max_rollout_turns": 3})
    check_config(cfg.model_copy(update={"grpo": three}), "grpo")


def test_sft_on_an_episode_trains_the_model_turns_only() -> None:
    """The tool message inside a calculator episode is context in SFT, as it is in GRPO."""
    from rlfleet.algorithms.sft.loop import sft_batch
    from rlfleet.data import build_prompts

    tokenizer = tiny_tokenizer()
    data = MasterConfig.model_validate(
        {"data": {"dataset_name": "multiplication", "multiplication": {"num_val": 2}}}
    )
    _, val = load_task(data.data)
    prompts = build_prompts(tokenizer, val, system_prompt=None, max_prompt_tokens=None)[0]
    batch = sft_batch(prompts, tokenizer, tokenizer.pad_token_id)
    for row, prompt in enumerate(prompts):
        start = len(prompt.token_ids)
        length = int(batch.attention_mask[row].sum())
        ids, mask = batch.input_ids[row], batch.response_mask[row]
        trained = [int(t) for t, m in zip(ids[start:length], mask[start:length], strict=True) if m]
        context = [int(t) for t, m in zip(ids[start:length], mask[start:length], strict=True) if not m]
        text = tokenizer.decode(trained, skip_special_tokens=False)
        assert text.startswith("<tool_call>") and text.endswith(f"#### {prompt.example.gold}<|im_end|>")
        assert (
            tokenizer.decode(context, skip_special_tokens=False)
            == f"<|im_end|>\n<|im_start|>tool\n{prompt.example.gold}<|im_end|>\n<|im_start|>assistant\n"
        )
    direct = MasterConfig.model_validate(
        {"data": {"dataset_name": "multiplication", "multiplication": {"sft_target": "direct"}}}
    )
    _, plain = load_task(direct.data)
    plain_prompts = build_prompts(tokenizer, plain[:2], system_prompt=None, max_prompt_tokens=None)[0]
    plain_batch = sft_batch(plain_prompts, tokenizer, tokenizer.pad_token_id)
    for row, prompt in enumerate(plain_prompts):
        assert float(plain_batch.response_mask[row].sum()) == int(
            plain_batch.attention_mask[row].sum()
        ) - len(prompt.token_ids)
