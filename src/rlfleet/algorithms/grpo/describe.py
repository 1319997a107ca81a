"""The algorithm a recipe configures, in a few words per part: what ``rlfleet plan`` and ``rlfleet validate``
print, so the variant a recipe selects (GRPO, DAPO, Dr.GRPO, GSPO, importance-sampling bounds) is visible
before anything runs."""

from __future__ import annotations

from rlfleet.config.backends import BACKENDS
from rlfleet.config.batching import ResolvedBatching, budget_key, recipe_batching
from rlfleet.config.resolved import generation_backend, policy_precision, truncation_type
from rlfleet.config.schema import MODEL_SCORED_ENVIRONMENTS, MasterConfig


def _loss(cfg: MasterConfig) -> str:
    lf = cfg.loss_fn
    if lf.sequence_level_importance_ratios:
        ratio = "sequence ratio (GSPO: geometric mean of token ratios)"
    else:
        ratio = "token ratio"
    clip = f"clipped to [{1 - lf.ratio_clip_min:g}, {1 + lf.ratio_clip_max:g}]"
    if lf.ratio_clip_c is not None:
        clip += f", dual clip c={lf.ratio_clip_c:g}"
    if lf.max_length_normalization:
        agg = f"token sums / {cfg.policy.generation.max_new_tokens} (Dr.GRPO constant), mean over sequences"
    elif lf.token_level_loss:
        agg = "mean over the global batch's tokens"
    else:
        agg = "mean of per-sequence means"
    kl = "no KL"
    if lf.reference_policy_kl_penalty > 0:
        kl = f"{lf.reference_policy_kl_type} KL x {lf.reference_policy_kl_penalty:g}"
        if lf.use_on_policy_kl_approximation:
            kl += ", weighted by pi / pi_gen"
    return f"{ratio} {clip}; {agg}; {kl}"


def _importance_sampling(cfg: MasterConfig) -> str:
    lf = cfg.loss_fn
    if not lf.use_importance_sampling_correction:
        return "off"
    level = "per sequence" if lf.sequence_level_importance_ratios else "per token"
    kind, high, low = (
        truncation_type(lf),
        lf.truncated_importance_sampling_ratio,
        lf.truncated_importance_sampling_ratio_min,
    )
    if kind is None:
        return f"pi_prev / pi_gen {level}, untruncated"
    if kind == "tis" and low:
        return f"pi_prev / pi_gen {level}, clamped to [{low:g}, {high:g}] (tis)"
    if kind == "tis":
        return f"pi_prev / pi_gen {level}, truncated at {high:g} (tis)"
    unit = "tokens" if kind == "icepop" else "sequences (geometric mean)"
    return f"pi_prev / pi_gen {level}, {unit} outside [{low:g}, {high:g}] masked ({kind})"


def _std(cfg: MasterConfig) -> str:
    g = cfg.grpo
    if g.advantage_std == "group" or not g.use_leave_one_out_baseline:
        return "advantages / group std"
    # continuous rewards (see group_advantages): the overlong penalty's, or a scoring model's
    continuous = ["the overlong penalty's"] if g.reward_shaping.enabled else []
    if cfg.data.env_name in MODEL_SCORED_ENVIRONMENTS:
        continuous.append(f"the {cfg.data.env_name} environment's")
    if continuous:
        return (
            f"advantages / std of the other samples (unbounded with {' and '.join(continuous)} continuous "
            "rewards, when a sample's peers nearly agree: grpo.advantage_std=group bounds |A| by sqrt(G))"
        )
    return "advantages / std of the other samples"


def _sampling(cfg: MasterConfig) -> str:
    g = cfg.grpo
    parts = [
        "leave-one-out baseline" if g.use_leave_one_out_baseline else "group-mean baseline",
        _std(cfg) if g.normalize_rewards else "no std normalisation",
    ]
    if g.use_dynamic_sampling:
        per_round = int(g.num_prompts_per_step * g.batch_multiplier)
        parts.append(
            f"dynamic sampling: {per_round} prompts per round, up to {g.dynamic_sampling_max_gen_batches} "
            f"rounds for {g.num_prompts_per_step} informative groups"
        )
    rs = g.reward_shaping
    if rs.enabled:
        limit = rs.max_response_length or cfg.policy.generation.max_new_tokens
        parts.append(
            f"overlong penalty up to {rs.overlong_buffer_penalty:g} over tokens "
            f"{limit - rs.overlong_buffer_length}..{limit}"
        )
    if g.overlong_filtering:
        parts.append("truncated responses masked from the loss")
    return "; ".join(parts)


def _schedule(cfg: MasterConfig) -> str:
    a = cfg.grpo.async_grpo
    if not a.enabled:
        return "synchronous: generate, then train, then refit"
    return (
        "asynchronous: the next step generates while this one trains; batches at most "
        f"{a.max_trajectory_age_steps} update(s) old"
    )


def _rollouts(cfg: MasterConfig) -> str:
    env, turns = cfg.data.env_name, cfg.grpo.max_rollout_turns
    if env == "math" and turns == 1:
        return "one response per sample, scored by env.math.reward_fn (the math environment)"
    return (
        f"episodes of up to {turns} model turn(s) with the {env} environment (rows may name others: "
        "task_name); observations masked out of the loss"
    )


def _precision(cfg: MasterConfig) -> str:
    resolved = policy_precision(cfg)
    if resolved.name == "float32":
        text = f"float32 ({resolved.reason})"
    else:
        text = f"{resolved.name} compute, float32 master weights and AdamW state ({resolved.reason})"
    if cfg.policy.torch_compile:
        text += "; decoder layers and logprobs compiled (torch.compile: the first pass compiles; cached)"
    return text


def _batching(cfg: MasterConfig, batching: ResolvedBatching) -> str:
    p = cfg.policy
    if batching.section is not None:
        train, logprob = (batching.micro_batch_tokens(p, x) for x in ("train", "logprob"))
        how = (
            f"{'packed sequences' if batching.section == 'sequence_packing' else 'dynamic batching'}, up to "
            f"{train:,} tokens per training pass and {logprob:,} per logprob pass"
        )
        bases: dict[str, list[str]] = {}
        for pass_, budget in batching.fitted().items():
            bases.setdefault(budget.why, []).append(budget_key(pass_))
        if bases:
            how += " (" + "; ".join(f"{' and '.join(named)}: {why}" for why, named in bases.items()) + ")"
    else:
        rows = f"{p.train_micro_batch_size} rows (training), {p.logprob_batch_size} (logprobs)"
        how = f"padded micro-batches of {rows}"
    if cfg.grpo.skip_zero_advantage_rows and cfg.loss_fn.reference_policy_kl_penalty == 0:
        how += "; rows with advantage 0 skipped (counted in the normaliser)"
    if p.logprob_chunk_size is not None:
        how += f"; logprobs from hidden states in chunks of {p.logprob_chunk_size:,} tokens (no full logits)"
    return how


def _generation(cfg: MasterConfig) -> str:
    backend = generation_backend(cfg)
    name = BACKENDS[backend.name].display_name
    return name if backend.reason == "set by the recipe" else f"{name} ({backend.reason})"


def describe_grpo(cfg: MasterConfig, batching: ResolvedBatching | None = None) -> list[tuple[str, str]]:
    """``(label, text)`` rows: the GRPO objective, the importance-sampling correction, the sampling, whether
    generation overlaps training, the rollouts, the compute dtype and the micro-batches (``batching``: the
    run's token budgets as resolved for this machine, ``rlfleet.memory.planner.resolve_batching``; by
    default the recipe's own, ``recipe_batching``)."""
    return [
        ("loss", _loss(cfg)),
        ("IS correction", _importance_sampling(cfg)),
        ("advantages", _sampling(cfg)),
        ("schedule", _schedule(cfg)),
        ("rollouts", _rollouts(cfg)),
        ("precision", _precision(cfg)),
        ("generation", _generation(cfg)),
        ("micro-batches", _batching(cfg, batching or recipe_batching(cfg.policy))),
    ]
