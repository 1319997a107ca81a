"""GRPO's own config checks, run by :func:`rlfleet.config.checks.check_config` for a GRPO run (its
description's ``checks``): the step's samples against the batch, lengths, the baseline, the loss variants
(importance-sampling bounds, GSPO, Dr.GRPO), DAPO and asynchronous GRPO. Each problem names the key, the
value, the constraint and a fix.
"""

from __future__ import annotations

import math

from rlfleet.config.backends import backend_of
from rlfleet.config.layout import ResourceLayout
from rlfleet.config.schema import MasterConfig
from rlfleet.config.shaping import shaping_problems
from rlfleet.utils.intmath import divisors_near


def grpo_problems(cfg: MasterConfig, layout: ResourceLayout) -> list[str]:
    """Everything GRPO's own keys, and the loss's, keep from running."""
    return (
        _batch_problems(cfg)
        + _length_problems(cfg)
        + _baseline_problems(cfg)
        + _loss_problems(cfg)
        + _dapo_problems(cfg)
        + _async_problems(cfg)
    )


def _batch_problems(cfg: MasterConfig) -> list[str]:
    batch, micro, problems = cfg.policy.train_global_batch_size, cfg.policy.train_micro_batch_size, []
    prompts, group = cfg.grpo.num_prompts_per_step, cfg.grpo.num_generations_per_prompt
    samples = prompts * group
    if samples % batch:
        step = batch // math.gcd(batch, group)
        prompts_hint = max(step, round(prompts / step) * step)
        suggestions = ", ".join(map(str, divisors_near(samples, batch, micro)))
        problems.append(
            f"grpo.num_prompts_per_step * grpo.num_generations_per_prompt = {prompts} * {group} = "
            f"{samples} samples per step, which policy.train_global_batch_size={batch} does not divide, "
            f"so the step's samples do not form whole optimizer batches; fix: set "
            f"policy.train_global_batch_size to a divisor of {samples} (e.g. {suggestions}) or "
            f"grpo.num_prompts_per_step to a multiple of {step} (e.g. {prompts_hint})"
        )
    return problems


def _length_problems(cfg: MasterConfig) -> list[str]:
    new_tokens, total = cfg.policy.generation.max_new_tokens, cfg.policy.max_total_sequence_length
    model_len = cfg.policy.generation.vllm_cfg.max_model_len
    problems = []
    if backend_of(cfg).reads_vllm_cfg and model_len is not None and model_len < total:
        problems.append(
            f"policy.generation.vllm_cfg.max_model_len={model_len} is shorter than "
            f"policy.max_total_sequence_length={total}, so vLLM would cut sequences the trainer expects; "
            f"fix: policy.generation.vllm_cfg.max_model_len={total} (or null to follow the sequence length)"
        )
    if new_tokens < total:
        return problems
    return [
        *problems,
        f"policy.generation.max_new_tokens={new_tokens} must be < policy.max_total_sequence_length={total}, "
        f"since the prompt and the response share that length; fix: lower policy.generation.max_new_tokens "
        f"(e.g. {max(1, total // 2)}) or raise policy.max_total_sequence_length (e.g. {2 * new_tokens})",
    ]


def _baseline_problems(cfg: MasterConfig) -> list[str]:
    if cfg.grpo.num_generations_per_prompt >= 2 or not cfg.grpo.use_leave_one_out_baseline:
        return []
    return [
        "grpo.use_leave_one_out_baseline=true needs grpo.num_generations_per_prompt >= 2 (got "
        f"{cfg.grpo.num_generations_per_prompt}): the baseline is the mean reward of the prompt's other "
        "samples; fix: set grpo.num_generations_per_prompt to 2 or more (e.g. 8) or "
        "grpo.use_leave_one_out_baseline=false"
    ]


# ------------------------------------------------------------------ GRPO variants (IS bounds, GSPO, DAPO)


def _loss_problems(cfg: MasterConfig) -> list[str]:
    """The importance-sampling bounds, GSPO and Dr.GRPO settings against each other."""
    lf, problems = cfg.loss_fn, []
    kind, high, low = (
        lf.truncated_importance_sampling_type,
        lf.truncated_importance_sampling_ratio,
        lf.truncated_importance_sampling_ratio_min,
    )
    bound_keys = [
        f"loss_fn.{name}={value}"
        for name, value in (
            ("truncated_importance_sampling_type", kind),
            ("truncated_importance_sampling_ratio", high),
            ("truncated_importance_sampling_ratio_min", low),
        )
        if value is not None
    ]
    if bound_keys and not lf.use_importance_sampling_correction:
        problems.append(
            f"{', '.join(bound_keys)} bound(s) the importance-sampling correction, but "
            "loss_fn.use_importance_sampling_correction=false, so they would be ignored; fix: "
            "loss_fn.use_importance_sampling_correction=true, or unset them (null)"
        )
    if lf.use_on_policy_kl_approximation and lf.reference_policy_kl_penalty == 0:
        problems.append(
            "loss_fn.use_on_policy_kl_approximation=true weights the KL penalty, but "
            "loss_fn.reference_policy_kl_penalty=0, so it would be ignored; fix: a positive "
            "reference_policy_kl_penalty, or use_on_policy_kl_approximation=false"
        )
    if kind is not None and high is None:
        problems.append(
            f"loss_fn.truncated_importance_sampling_type={kind} needs "
            "loss_fn.truncated_importance_sampling_ratio (the cap, or the band's upper end); fix: set it "
            "(e.g. 2.0 for tis, 5.0 for icepop, 1.002 for seq-mask-tis)"
        )
    if kind in ("icepop", "seq-mask-tis") and low is None:
        problems.append(
            f"loss_fn.truncated_importance_sampling_type={kind} masks outside [ratio_min, ratio]: set "
            "loss_fn.truncated_importance_sampling_ratio_min (e.g. 0.5 for icepop, 0.999 for seq-mask-tis)"
        )
    if low is not None and kind is None:
        problems.append(
            f"loss_fn.truncated_importance_sampling_ratio_min={low} bounds a truncation, but "
            "loss_fn.truncated_importance_sampling_type is null; fix: set the type (tis clamps to "
            "[ratio_min, ratio]; icepop and seq-mask-tis mask outside it), or unset ratio_min"
        )
    if low is not None and high is not None and low > high:
        problems.append(
            f"loss_fn.truncated_importance_sampling_ratio_min={low} must be <= "
            f"loss_fn.truncated_importance_sampling_ratio={high}; fix: a band with min < 1 < max"
        )
    if kind == "seq-mask-tis" and lf.sequence_level_importance_ratios:
        problems.append(
            "loss_fn.truncated_importance_sampling_type=seq-mask-tis masks sequences of token-level weights, "
            "but loss_fn.sequence_level_importance_ratios=true weights whole sequences; fix: type tis or "
            "icepop, or sequence_level_importance_ratios=false"
        )
    for key, on in (
        ("sequence_level_importance_ratios", lf.sequence_level_importance_ratios),
        ("max_length_normalization", lf.max_length_normalization),
    ):
        if on and lf.token_level_loss:
            problems.append(
                f"loss_fn.{key}=true aggregates the loss per sequence, but loss_fn.token_level_loss=true "
                "averages over tokens; fix: loss_fn.token_level_loss=false"
            )
    if lf.sequence_level_importance_ratios and lf.max_length_normalization:
        problems.append(
            "loss_fn.sequence_level_importance_ratios=true (GSPO) and loss_fn.max_length_normalization=true "
            "(Dr.GRPO) are different objectives; fix: set one of them to false"
        )
    return problems


def _dapo_problems(cfg: MasterConfig) -> list[str]:
    """Dynamic sampling and overlong shaping against the batch and length settings."""
    g, problems = cfg.grpo, []
    if g.batch_multiplier != 1.0 and not g.use_dynamic_sampling:
        problems.append(
            f"grpo.batch_multiplier={g.batch_multiplier} scales the prompts drawn per dynamic-sampling "
            "round, but grpo.use_dynamic_sampling=false; fix: grpo.use_dynamic_sampling=true or "
            "grpo.batch_multiplier=1"
        )
    if g.use_dynamic_sampling and g.num_generations_per_prompt < 2:
        problems.append(
            "grpo.use_dynamic_sampling=true keeps groups whose rewards differ, which needs "
            f"grpo.num_generations_per_prompt >= 2 (got {g.num_generations_per_prompt}); fix: raise it"
        )
    problems += shaping_problems(
        g.reward_shaping, "grpo.reward_shaping", cfg.policy.generation.max_new_tokens
    )
    return problems


def _async_problems(cfg: MasterConfig) -> list[str]:
    """Asynchronous GRPO needs dedicated generation workers and the importance-sampling correction."""
    if not cfg.grpo.async_grpo.enabled:
        return []
    problems = []
    if cfg.policy.generation.colocated.enabled:
        problems.append(
            "grpo.async_grpo.enabled=true overlaps generation with training, but generation is colocated "
            "with the trainers (policy.generation.colocated.enabled=true), so the two would share the same "
            "devices and take turns; fix: policy.generation.colocated.enabled=false with "
            "policy.generation.colocated.resources.{num_nodes,gpus_per_node} for the generation workers, "
            "or grpo.async_grpo.enabled=false"
        )
    if not cfg.loss_fn.use_importance_sampling_correction:
        problems.append(
            "grpo.async_grpo.enabled=true trains on rollouts sampled by the previous weights, which only the "
            "importance-sampling correction accounts for; fix: "
            "loss_fn.use_importance_sampling_correction=true (a cap such as "
            "loss_fn.truncated_importance_sampling_ratio=2.0 is advised)"
        )
    return problems
