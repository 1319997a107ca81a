"""The loss and sampling variants' keys: NeMo RL names, cross-field errors naming key and fix, and the
summary ``rlfleet validate``/``plan`` print."""

from __future__ import annotations

import pytest

from rlfleet.algorithms.grpo.describe import describe_grpo
from rlfleet.cli import main
from rlfleet.config import ConfigError, apply_overrides, check_config, validate_config
from rlfleet.config.resolved import truncation_type
from tests.unit.test_config import good_raw


def _check(*overrides: str) -> None:
    check_config(validate_config(apply_overrides(good_raw(), list(overrides))), "grpo")


@pytest.mark.parametrize(
    "overrides",
    [
        [
            "loss_fn.use_importance_sampling_correction=true",
            "loss_fn.truncated_importance_sampling_ratio=2.0",
        ],
        [
            "loss_fn.use_importance_sampling_correction=true",
            "loss_fn.truncated_importance_sampling_type=icepop",
            "loss_fn.truncated_importance_sampling_ratio=5.0",
            "loss_fn.truncated_importance_sampling_ratio_min=0.5",
        ],
        [  # NeMo RL's tis with a floor: clamp(w, 0.5, 2)
            "loss_fn.use_importance_sampling_correction=true",
            "loss_fn.truncated_importance_sampling_type=tis",
            "loss_fn.truncated_importance_sampling_ratio=2.0",
            "loss_fn.truncated_importance_sampling_ratio_min=0.5",
        ],
        ["loss_fn.reference_policy_kl_type=k2", "loss_fn.use_on_policy_kl_approximation=true"],
        ["loss_fn.sequence_level_importance_ratios=true", "loss_fn.token_level_loss=false"],
        [
            "loss_fn.max_length_normalization=true",
            "loss_fn.token_level_loss=false",
            "grpo.normalize_rewards=false",
        ],
        [
            "grpo.use_dynamic_sampling=true",
            "grpo.batch_multiplier=1.5",
            "grpo.dynamic_sampling_max_gen_batches=3",
            "grpo.reward_shaping.enabled=true",
            "grpo.reward_shaping.overlong_buffer_length=16",
            "grpo.overlong_filtering=true",
        ],
    ],
)
def test_coherent_variant_configs_pass(overrides: list[str]) -> None:
    _check(*overrides)


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (
            ["loss_fn.truncated_importance_sampling_ratio=2.0"],
            "but loss_fn.use_importance_sampling_correction=false, so they would be ignored; fix: "
            "loss_fn.use_importance_sampling_correction=true",
        ),
        (
            [
                "loss_fn.use_importance_sampling_correction=true",
                "loss_fn.truncated_importance_sampling_type=tis",
            ],
            "needs loss_fn.truncated_importance_sampling_ratio",
        ),
        (
            [
                "loss_fn.use_importance_sampling_correction=true",
                "loss_fn.truncated_importance_sampling_type=icepop",
                "loss_fn.truncated_importance_sampling_ratio=5",
            ],
            "set loss_fn.truncated_importance_sampling_ratio_min",
        ),
        (
            [
                "loss_fn.use_importance_sampling_correction=true",
                "loss_fn.truncated_importance_sampling_ratio=2",
                "loss_fn.truncated_importance_sampling_ratio_min=0.5",
            ],
            "loss_fn.truncated_importance_sampling_type is null; fix: set the type",
        ),
        (
            [
                "loss_fn.use_importance_sampling_correction=true",
                "loss_fn.truncated_importance_sampling_type=icepop",
                "loss_fn.truncated_importance_sampling_ratio=0.5",
                "loss_fn.truncated_importance_sampling_ratio_min=2",
            ],
            "must be <= loss_fn.truncated_importance_sampling_ratio=0.5",
        ),
        (
            ["loss_fn.use_on_policy_kl_approximation=true", "loss_fn.reference_policy_kl_penalty=0"],
            "loss_fn.reference_policy_kl_penalty=0, so it would be ignored",
        ),
        (["loss_fn.sequence_level_importance_ratios=true"], "fix: loss_fn.token_level_loss=false"),
        (["loss_fn.max_length_normalization=true"], "fix: loss_fn.token_level_loss=false"),
        (["grpo.batch_multiplier=2"], "fix: grpo.use_dynamic_sampling=true or grpo.batch_multiplier=1"),
        (
            ["grpo.reward_shaping.enabled=true", "grpo.reward_shaping.overlong_buffer_length=100"],
            "overlong_buffer_length=100 exceeds the response limit 64",
        ),
        (
            ["grpo.reward_shaping.enabled=true", "grpo.reward_shaping.max_response_length=512"],
            "so it would never apply",
        ),
    ],
)
def test_incoherent_variant_configs_name_the_key_and_the_fix(overrides: list[str], fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        _check(*overrides)
    assert fragment in str(err.value)


def test_nemo_rl_type_names_are_the_only_ones_accepted() -> None:
    with pytest.raises(ConfigError, match="truncated_importance_sampling_type"):
        validate_config(apply_overrides(good_raw(), ["loss_fn.truncated_importance_sampling_type=clip"]))
    with pytest.raises(ConfigError, match="batch_multiplier"):
        validate_config(apply_overrides(good_raw(), ["grpo.batch_multiplier=0.5"]))


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ([], None),
        (["loss_fn.truncated_importance_sampling_ratio=2"], "tis"),  # a cap alone means tis
        (["loss_fn.truncated_importance_sampling_type=tis"], "tis"),
        (["loss_fn.truncated_importance_sampling_type=icepop"], "icepop"),
        (["loss_fn.truncated_importance_sampling_type=seq-mask-tis"], "seq-mask-tis"),
        (["loss_fn.truncated_importance_sampling_ratio_min=0.5"], None),
    ],
)
def test_truncation_type_resolves_a_cap_alone_to_tis(overrides: list[str], expected: str | None) -> None:
    cfg = validate_config(apply_overrides(good_raw(), overrides))
    assert truncation_type(cfg.loss_fn) == expected


def test_summary_names_each_variant() -> None:
    def summary(*overrides: str) -> str:
        return str(describe_grpo(validate_config(apply_overrides(good_raw(), list(overrides)))))

    assert "token ratio clipped to [0.8, 1.2]" in summary() and "IS correction', 'off'" in summary()
    gspo = summary("loss_fn.sequence_level_importance_ratios=true", "loss_fn.ratio_clip_min=3e-4")
    assert "sequence ratio (GSPO" in gspo and "0.9997" in gspo
    assert "token sums / 64 (Dr.GRPO" in summary("loss_fn.max_length_normalization=true")
    assert "compiled (torch.compile" in summary("policy.torch_compile=true")
    assert "compiled" not in summary()
    assert "truncated at 2 (tis)" in summary(
        "loss_fn.use_importance_sampling_correction=true", "loss_fn.truncated_importance_sampling_ratio=2"
    )
    assert "clamped to [0.5, 2] (tis)" in summary(
        "loss_fn.use_importance_sampling_correction=true",
        "loss_fn.truncated_importance_sampling_type=tis",
        "loss_fn.truncated_importance_sampling_ratio=2",
        "loss_fn.truncated_importance_sampling_ratio_min=0.5",
    )
    assert "k3 KL x 0.01" in summary() and "k1 KL x 0.01, weighted by pi / pi_gen" in summary(
        "loss_fn.reference_policy_kl_type=k1", "loss_fn.use_on_policy_kl_approximation=true"
    )
    dapo = summary(
        "grpo.use_dynamic_sampling=true",
        "grpo.batch_multiplier=2",
        "grpo.reward_shaping.enabled=true",
        "grpo.reward_shaping.overlong_buffer_length=16",
        "grpo.overlong_filtering=true",
    )
    assert "16 prompts per round, up to 10 rounds for 8 informative groups" in dapo
    assert "overlong penalty up to 1 over tokens 48..64" in dapo and "truncated responses masked" in dapo
    assert "unbounded with the overlong penalty" in dapo and "advantage_std=group bounds" in dapo
    assert "unbounded" not in summary("grpo.reward_shaping.enabled=true", "grpo.advantage_std=group")
    # a reward model's or a judge's scores are continuous too (benchmarks/reward_models.py: losses of 12,926)
    for env in ("reward_model", "judge"):
        scoring = (f"data.env_name={env}", f"env.{env}.model_name=org/scorer")
        assert f"unbounded with the {env} environment's continuous rewards" in summary(*scoring)
        assert "advantage_std=group bounds" in summary(*scoring)
        assert "unbounded" not in summary(*scoring, "grpo.advantage_std=group")
    assert "unbounded" not in summary("data.env_name=tools")
    assert "synchronous: generate, then train" in summary()
    assert "one response per sample" in summary()
    assert "episodes of up to 3 model turn(s) with the tools environment" in summary(
        "data.env_name=tools", "grpo.max_rollout_turns=3"
    )
    overlapped = summary(
        "grpo.async_grpo.enabled=true",
        "grpo.async_grpo.max_trajectory_age_steps=2",
        "loss_fn.use_importance_sampling_correction=true",
        "policy.generation.colocated.enabled=false",
        "policy.generation.colocated.resources.gpus_per_node=1",
        "cluster.gpus_per_node=2",
    )
    assert (
        "asynchronous: the next step generates while this one trains; batches at most 2 update(s)"
        in overlapped
    )


def test_validate_prints_the_configured_variant(capsys) -> None:
    args = [
        "policy.model_name=x",
        "loss_fn.sequence_level_importance_ratios=true",
        "loss_fn.token_level_loss=false",
    ]
    assert main(["validate", "grpo-tiny-arithmetic-cpu", *args]) == 0
    out = capsys.readouterr().out
    assert "sequence_level_importance_ratios: true" in out and "#   loss: sequence ratio (GSPO" in out
    assert main(["plan", "grpo-tiny-arithmetic-cpu", *args]) == 0
    assert "sequence ratio (GSPO" in capsys.readouterr().out


def test_torch_compile_is_refused_on_ray_and_allowed_in_one_process() -> None:
    from rlfleet.config.checks import unsupported_settings

    def problems(*overrides: str) -> list[str]:
        cfg = validate_config(apply_overrides(good_raw(), ["policy.torch_compile=true", *overrides]))
        return [p for p in unsupported_settings(cfg, here=False) if "torch_compile" in p]

    assert problems() == []
    for ray in (["cluster.gpus_per_node=2"], ["cluster.use_ray=true"]):
        [problem] = problems(*ray)
        assert "fix: policy.torch_compile=false" in problem
