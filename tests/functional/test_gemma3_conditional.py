"""The seed's checkpoint as the seed names it: ``google/gemma-3-27b-it`` is a
``Gemma3ForConditionalGeneration`` (a SigLIP vision tower, a projector and the Gemma 3 text model with its
5:1 sliding/global layers and QK-norm). Trained on text, its language model and output layer learn and the
vision tower and projector are kept frozen (``rlfleet.policy.build.freeze_outside_text_decoder``): no
gradient, no optimizer state, written back unchanged, so a run resumes and its export loads as the original
model did. Here on a tiny one built from a config: two GRPO steps, a checkpoint, a resumed third, the
export reloaded by transformers with the trained policy's logits; and the tensor-parallel plan splitting
every projection of its text layers.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Gemma3Config, Gemma3ForConditionalGeneration

from rlfleet.algorithms.grpo.loop import GRPO
from rlfleet.checkpoint import export_hf
from rlfleet.logging import read_metrics
from rlfleet.models.tiny import create_tiny_model
from rlfleet.runtime.loop import closing_run
from tests.conftest import TEST_SPEC, _arithmetic_corpus, small_grpo_config
from tests.functional.test_rehearse import rank_job, run_rank_in_process

ROOT = Path(__file__).resolve().parents[2]
DENSE = "env.math.reward_fn=tests.functional.rewards_for_tests.digit_fraction_reward"


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A randomly initialised tiny Gemma3ForConditionalGeneration with the tests' arithmetic tokenizer."""
    out = tmp_path_factory.mktemp("gemma3") / "model"
    create_tiny_model(out, _arithmetic_corpus(), TEST_SPEC, seed=0)  # its tokenizer, then the model replaced
    tokenizer = AutoTokenizer.from_pretrained(out)
    vocab = TEST_SPEC.vocab_size
    config = Gemma3Config(
        text_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 6,  # five sliding-window layers, then a global one
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "vocab_size": vocab,
            "sliding_window": 8,
            "max_position_embeddings": 256,
            "query_pre_attn_scalar": 16,
            "rope_scaling": None,
        },
        vision_config={
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": 28,
            "patch_size": 14,
        },
        mm_tokens_per_image=4,
        image_token_index=vocab - 1,
        boi_token_index=vocab - 2,
        eoi_token_index=vocab - 3,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    Gemma3ForConditionalGeneration(config).save_pretrained(out)
    return out


def _vision(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if "vision_tower" in k or "multi_modal_projector" in k}


@pytest.mark.slow
def test_train_resume_export_of_a_conditional_generation_gemma3(tiny_gemma3: Path, tmp_path: Path) -> None:
    config = json.loads((tiny_gemma3 / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForConditionalGeneration"]
    layer_types = config["text_config"]["layer_types"]
    assert layer_types == ["sliding_attention"] * 5 + ["full_attention"]

    GRPO.run(small_grpo_config(tiny_gemma3, tmp_path, DENSE, "grpo.max_num_steps=2"))
    resumed = small_grpo_config(tiny_gemma3, tmp_path, DENSE, "grpo.max_num_steps=3")
    GRPO.run(resumed)  # from step_2: the optimizer state holds the text model's parameters only
    assert [r["step"] for r in read_metrics(tmp_path / "logs")] == [0, 1, 2, 3]

    exported = export_hf(tmp_path / "ckpt" / "step_3", tmp_path / "exported")
    reloaded = AutoModelForCausalLM.from_pretrained(exported)
    assert type(reloaded).__name__ == "Gemma3ForConditionalGeneration"
    trainer = GRPO(resumed)  # resumes at step 3: the trained weights
    with closing_run(trainer.ctx):  # its environment workers, policy and loggers released after
        policy = trainer.ctx.policy.model
        frozen = [n for n, p in policy.named_parameters() if not p.requires_grad]
        assert frozen and all("vision_tower" in n or "multi_modal_projector" in n for n in frozen)
        ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]])  # past the sliding window of 8
        with torch.no_grad():
            torch.testing.assert_close(reloaded(input_ids=ids).logits, policy(input_ids=ids).logits)
    original = AutoModelForCausalLM.from_pretrained(tiny_gemma3).state_dict()
    after = reloaded.state_dict()
    vision = _vision(original)
    assert vision and all(torch.equal(after[k], v) for k, v in vision.items())  # written back unchanged
    text = [k for k in original if "language_model" in k and k.endswith("q_proj.weight")]
    assert text and any(not torch.equal(after[k], original[k]) for k in text)  # the text model learned


def test_the_tensor_parallel_plan_splits_every_projection_of_its_text_layers(tiny_gemma3: Path) -> None:
    """rlfleet's plan on the conditional-generation layout (layers under ``model.language_model``), checked
    in a fake world of 2 tensor-parallel ranks: every q/k/v/o and gate/up/down split, the vision tower left
    whole on purpose, and a training step rehearsed."""
    job = rank_job(
        tiny_gemma3,
        role="rank 0 of 2 (TP 2)",
        world=2,
        precision="float32",
        keep_reference=False,
        train_rows=1,
        train_tokens=32,
        logprob_rows=1,
        logprob_tokens=32,
    )
    result = run_rank_in_process(job)
    assert result["unsharded"] == [] and result["peak"] > 0
    assert result["parameters_here"] < result["parameters"]
