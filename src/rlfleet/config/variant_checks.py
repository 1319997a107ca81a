"""Cross-field checks of the GRPO variants (importance-sampling bounds, GSPO, Dr.GRPO, DAPO): each problem
names the key, the value, why it cannot work and the fix; :func:`rlfleet.config.check_config` reports them
with every other problem at once."""

from __future__ import annotations

from rlfleet.config.schema import MasterConfig


def variant_problems(cfg: MasterConfig) -> list[str]:
    """Every problem of the loss and sampling variants' settings."""
    return loss_problems(cfg) + dapo_problems(cfg) + async_problems(cfg)


def async_problems(cfg: MasterConfig) -> list[str]:
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


def loss_problems(cfg: MasterConfig) -> list[str]:
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


def dapo_problems(cfg: MasterConfig) -> list[str]:
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
    rs, new_tokens = g.reward_shaping, cfg.policy.generation.max_new_tokens
    limit = rs.max_response_length or new_tokens
    if rs.enabled and rs.overlong_buffer_length > limit:
        problems.append(
            f"grpo.reward_shaping.overlong_buffer_length={rs.overlong_buffer_length} exceeds the response "
            f"limit {limit} (reward_shaping.max_response_length, else policy.generation.max_new_tokens); "
            f"fix: a buffer of at most {limit} tokens (DAPO: a fifth of the limit, e.g. {max(1, limit // 5)})"
        )
    elif rs.enabled and limit - rs.overlong_buffer_length >= new_tokens:
        problems.append(
            f"grpo.reward_shaping: the penalty starts after {limit - rs.overlong_buffer_length} tokens "
            f"(max_response_length {limit} - overlong_buffer_length {rs.overlong_buffer_length}), but "
            f"responses stop at policy.generation.max_new_tokens={new_tokens}, so it would never apply; fix: "
            f"grpo.reward_shaping.max_response_length=null (follows max_new_tokens) or a longer buffer"
        )
    return problems
