"""``rlfleet rehearse``: a recipe's training rank at its real scale on a fake process group, its peak memory
measured by torch's FSDP2 memory tracker beside ``plan``'s estimate; the tensor-parallel plan checked to split
every linear weight of the decoder layers. The seed recipe's own rehearsal (27B, 8 ranks) is
``benchmarks/rehearse.py``'s; here a small Llama-shaped configuration (no weights) keeps it to seconds."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import pytest
from transformers import LlamaConfig

from rlfleet.cli import main
from rlfleet.config import load_recipe, resolve_recipe_path
from rlfleet.config.architectures import architecture_of, shipped_model_config, shipped_model_names
from rlfleet.config.layout import resource_layout
from rlfleet.errors import UserError
from rlfleet.runtime import rehearse as rehearse_module
from rlfleet.runtime.rehearse import RankJob, generation_rows, rank_jobs

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def small_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama-shaped model's config.json alone (the rehearsal needs no weights)."""
    directory = tmp_path_factory.mktemp("small") / "model"
    config = LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=2048,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    config.save_pretrained(directory)
    return directory


def rank_job(model: Path, **changes: object) -> RankJob:
    job = RankJob(
        role="training rank 0 of 4 (TP 2 x DP 2)",
        model_name=str(model),
        precision="bfloat16",
        world=4,
        rank=0,
        tensor_parallel=2,
        activation_checkpointing=True,
        keep_reference=True,
        train_rows=2,
        train_tokens=128,
        logprob_rows=4,
        logprob_tokens=128,
        logprob_chunk=None,
        lr=1e-6,
    )
    return replace(job, **changes)  # type: ignore[arg-type]


def run_rank_in_process(job: RankJob, patch: str = "") -> dict[str, object]:
    """``run_rank`` in a process of its own (a fake world is one per process), after ``patch``."""
    code = (
        "import json, sys\n"
        "from rlfleet.runtime.rehearse import RankJob, run_rank\n"
        f"{patch}\n"
        "print(json.dumps(run_rank(RankJob(**json.loads(sys.argv[1])))))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, json.dumps(asdict(job))],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_a_sharded_rank_is_measured_by_kind(small_config: Path) -> None:
    result = run_rank_in_process(rank_job(small_config))
    assert result["unsharded"] == []
    h, i, v, layers, kv = 256, 512, 2048, 4, 4 * 32  # the config's sizes (head_dim 32, 4 KV heads)
    layer = h * (h + kv + kv + h) + 3 * h * i + 2 * h  # q, k, v, o; gate, up, down; two norms
    split, whole = layers * (layer - 2 * h), 2 * v * h + h + layers * 2 * h  # TP splits the projections only
    assert result["parameters"] == split + whole
    # a quarter of the projections on each of 4 ranks (TP 2 x DP 2); what TP leaves whole over the 2 DP ranks
    assert result["parameters_here"] == split // 4 + whole // 2
    kinds = result["bytes"]
    assert isinstance(kinds, dict)
    assert all(kinds[k] > 0 for k in ("parameters", "optimizer", "activations"))
    assert result["peak"] >= sum(kinds.values()) * 0.999  # type: ignore[operator]
    # AdamW's two float32 moments of every trained weight, held by the step that measured them
    assert kinds["optimizer"] == pytest.approx(8 * result["parameters_here"], rel=0.01)
    # the float32 masters and the reference's shards in the compute dtype (bfloat16)
    assert kinds["parameters"] >= 6 * result["parameters_here"]  # type: ignore[operator]


def test_a_plan_that_misses_a_projection_is_refused(small_config: Path) -> None:
    """The plan without the MLP's up projection: every layer's up_proj stays whole on both TP ranks."""
    patch = (
        "import rlfleet.policy.parallelize as p\n"
        "p._COLWISE = tuple(n for n in p._COLWISE if n != 'mlp.up_proj')"
    )
    result = run_rank_in_process(rank_job(small_config), patch)
    assert result["unsharded"] == [f"layer {i}: mlp.up_proj" for i in range(4)]


def test_rehearse_refuses_what_a_rank_found_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_recipe(resolve_recipe_path("grpo-gemma3-27b-it-2n8g-fsdp2tp8-noncolocated"))
    found = {"role": "training rank 0 of 8 (TP 8 x DP 1)", "unsharded": ["layer 0: mlp.up_proj"]}
    monkeypatch.setattr(rehearse_module, "_run_rank_process", lambda job: found)
    with pytest.raises(UserError, match=r"leaves these linear weights whole.*layer 0: mlp.up_proj.*fix:"):
        rehearse_module.rehearse(cfg)


def test_the_seed_recipe_rehearses_its_real_layout() -> None:
    """The seed's ranks as the rehearsal runs them: 8 training ranks of TP 8, the recipe's token budgets, the
    reference kept (a KL term), from the shipped gemma-3-27b-it configuration."""
    cfg = load_recipe(resolve_recipe_path("grpo-gemma3-27b-it-2n8g-fsdp2tp8-noncolocated"))
    (job,) = rank_jobs(cfg, resource_layout(cfg))
    assert (job.world, job.tensor_parallel, job.keep_reference) == (8, 8, True)
    assert (job.train_rows, job.train_tokens, job.logprob_rows) == (1, 2048, 2)
    assert shipped_model_config(job.model_name) is not None and job.activation_checkpointing
    rows = dict(generation_rows(cfg, resource_layout(cfg)))
    assert rows["generation TP"] == "8: heads and KV heads divide"
    assert rows["weights per GPU"].startswith("6.9 GB (27.43B parameters")
    # the dedicated engine's refit: every weight in bfloat16 (the tied embedding is sent under both names)
    assert "253 buckets" in rows["refit per step"] and "57.7 GB broadcast" in rows["refit per step"]


def test_every_shipped_gpu_recipe_names_a_shipped_configuration() -> None:
    """So plan and the rehearsal build the real architecture, and no recipe hand-writes one."""
    for recipe in sorted((ROOT / "recipes").glob("*.yaml")):
        cfg = load_recipe(recipe)
        if cfg.policy.model_name.startswith(("runs/", "results/", "package:")):
            continue  # built or exported here, or a PyPI package's model: its own config.json
        assert cfg.policy.model_name in shipped_model_names(), recipe.name
        assert "architecture:" not in recipe.read_text(encoding="utf-8"), recipe.name


def test_the_shipped_configuration_is_the_real_architecture() -> None:
    """gemma-3-27b-it is a conditional-generation model: its text decoder and, beside it, the vision tower
    and projector every rank loads."""
    from rlfleet.config.architectures import load_model_config

    arch = architecture_of(load_model_config("google/gemma-3-27b-it"))
    assert (arch.hidden_size, arch.num_hidden_layers, arch.num_key_value_heads, arch.head_dim) == (
        5376,
        62,
        16,
        128,
    )
    assert arch.vocab_size == 262208 and arch.tie_word_embeddings
    assert 0.40e9 < arch.other_parameters < 0.45e9  # SigLIP-so400m and the projector


def test_a_recipe_that_contradicts_the_shipped_configuration_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(
        [
            "validate",
            "grpo-qwen2.5-0.5b-gsm8k-1n1g",
            "+policy.architecture={hidden_size: 1024, num_hidden_layers: 24, num_attention_heads: 14, "
            "num_key_value_heads: 2, intermediate_size: 4864, vocab_size: 151936, tie_word_embeddings: true}",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "hidden_size: 1024 here, 896 in config.json" in err and "fix: remove" in err


def test_the_benchmark_rehearses_every_gpu_recipe() -> None:
    from benchmarks.rehearse import gpu_recipes

    assert gpu_recipes() == ["grpo-gemma3-27b-it-2n8g-fsdp2tp8-noncolocated", "grpo-qwen2.5-0.5b-gsm8k-1n1g"]
