"""The checks of learning from preference pairs (DPO, reward models), one of the parts of
:func:`rlfleet.config.checks.check_config`: what data each algorithm trains on, pairs against the batch
and the token budgets, and what a reward model cannot do. Each problem names the key, the value, the
constraint and a fix.
"""

from __future__ import annotations

from pathlib import Path

from rlfleet.config.batching import budget_key, recipe_budget, token_budget_section
from rlfleet.config.embedded import GENERATED_DATA
from rlfleet.config.layout import ResourceLayout
from rlfleet.config.preference import PREFERENCE_DATASETS, REWARD_MODEL_TYPES
from rlfleet.config.schema import MasterConfig
from rlfleet.config.shaping import shaping_problems
from rlfleet.utils.intmath import round_up

PAIR_ALGORITHMS = ("dpo", "rm")  # the algorithms that train on (chosen, rejected) pairs


def preference_problems(cfg: MasterConfig, algorithm: str, layout: ResourceLayout) -> list[str]:
    """Everything about preference pairs and reward models that keeps ``cfg`` from running ``algorithm``."""
    problems = _data_problems(cfg, algorithm) + _generated_data_problems(cfg)
    if algorithm == "rm":
        problems += _reward_model_problems(cfg)
    elif cfg.policy.reward_model_cfg.enabled:
        problems.append(
            f"policy.reward_model_cfg.enabled=true loads the model as a reward model (a score head, no "
            f"language-model head), which {algorithm} cannot train or sample from; fix: "
            "policy.reward_model_cfg.enabled=false, or `rlfleet rm` to train a reward model"
        )
    if algorithm in PAIR_ALGORITHMS:
        problems += _pair_problems(cfg, algorithm, layout)
    if algorithm == "dpo":
        problems += _sampled_pairs_problems(cfg)
    return problems


def _sampled_pairs_problems(cfg: MasterConfig) -> list[str]:
    """DPO's overlong shaping of its own samples: against the response limit, and only where it samples."""
    key, shaping = "dpo.sampled_pairs.reward_shaping", cfg.dpo.sampled_pairs.reward_shaping
    if shaping.enabled and cfg.data.dataset_name in PREFERENCE_DATASETS:
        return [
            f"{key}.enabled=true ranks the model's own samples, but data.dataset_name="
            f"{cfg.data.dataset_name} gives the pairs (nothing is sampled); fix: {key}.enabled=false, or a "
            "task dataset to sample pairs from"
        ]
    return shaping_problems(shaping, key, cfg.policy.generation.max_new_tokens)


def _data_problems(cfg: MasterConfig, algorithm: str) -> list[str]:
    name, preference = cfg.data.dataset_name, cfg.data.dataset_name in PREFERENCE_DATASETS
    if algorithm == "rm" and not preference:
        return [
            f"data.dataset_name: {name} is a task (prompts and answers), but a reward model trains on "
            "preference pairs (a chosen and a rejected reply; pairs sampled from the reward model itself "
            "make no sense); fix: data.dataset_name=PreferenceDataset or BinaryPreferenceDataset with "
            "data.train_data_path and data.val_data_path (e.g. `rlfleet data arithmetic-pairs DIR` writes "
            "arithmetic pairs)"
        ]
    if algorithm not in PAIR_ALGORITHMS and preference:
        return [
            f"data.dataset_name: {name} is preference data (chosen and rejected replies), which "
            f"{algorithm} cannot train on; fix: `rlfleet dpo` or `rlfleet rm` on it, or a task dataset for "
            f"{algorithm}"
        ]
    return []


def _generated_data_problems(cfg: MasterConfig) -> list[str]:
    """A shipped recipe's data file that its generating command has not written yet: that command."""
    problems = []
    for key in ("train_data_path", "val_data_path"):
        path = getattr(cfg.data, key)
        if path is None or Path(path).is_file():
            continue
        for directory, command in GENERATED_DATA.items():
            if Path(path).parent == Path(directory):
                problems.append(
                    f"data.{key}={path}: that file is not written yet; `{command}` writes it, or set "
                    f"data.{key} to a file of yours"
                )
    return problems


def _reward_model_problems(cfg: MasterConfig) -> list[str]:
    """What ``rlfleet rm`` needs of the policy section."""
    p, problems = cfg.policy, []
    rm_cfg = p.reward_model_cfg
    if not rm_cfg.enabled:
        problems.append(
            "policy.reward_model_cfg.enabled=false, but `rlfleet rm` trains the model loaded as a reward "
            "model (a one-label score head on the backbone of policy.model_name); fix: "
            "policy.reward_model_cfg.enabled=true"
        )
    if rm_cfg.reward_model_type not in REWARD_MODEL_TYPES:
        problems.append(
            f"policy.reward_model_cfg.reward_model_type: got {rm_cfg.reward_model_type!r}, but this build "
            f"trains {', '.join(REWARD_MODEL_TYPES)} reward models only (NeMo RL's regression type is not "
            "implemented); fix: policy.reward_model_cfg.reward_model_type=bradley_terry"
        )
    if p.dtensor_cfg.lora_cfg.enabled:
        problems.append(
            "policy.dtensor_cfg.lora_cfg.enabled=true: LoRA freezes every weight but its adapters, so the "
            "reward model's new score head would stay at its random start; fix: lora_cfg.enabled=false "
            "(full fine-tuning)"
        )
    if p.logprob_chunk_size is not None:
        problems.append(
            f"policy.logprob_chunk_size={p.logprob_chunk_size}: a reward model has one score per token, no "
            "vocabulary logits to compute in chunks, so the setting would be ignored; fix: "
            "policy.logprob_chunk_size=null"
        )
    if not p.generation.colocated.enabled:
        problems.append(
            "policy.generation.colocated.enabled=false sets GPUs aside for generation, but a reward model "
            "generates nothing, so they would stay idle; fix: policy.generation.colocated.enabled=true "
            "(every GPU of the cluster trains)"
        )
    return problems


def _pair_problems(cfg: MasterConfig, algorithm: str, layout: ResourceLayout) -> list[str]:
    """Pairs: whole pairs on every data-parallel rank, and a pair's two rows in one micro-batch."""
    p, problems, what = cfg.policy, [], algorithm.upper()
    if p.train_global_batch_size % layout.train_dp:
        problems.append(
            f"policy.train_global_batch_size={p.train_global_batch_size} pairs do not split over the "
            f"{layout.train_dp} data-parallel training ranks ({what} trains whole pairs on each rank); fix: "
            f"a multiple of {layout.train_dp}"
        )
    name = token_budget_section(p)
    if name is None:
        return problems
    round_to = p.dynamic_batching.sequence_length_round if name == "dynamic_batching" else 1
    pair = 2 * round_up(p.max_total_sequence_length, round_to)
    tokens = recipe_budget(p, name, "train").tokens
    if tokens < pair:
        problems.append(
            f"policy.{name}.{budget_key('train')}={tokens} cannot hold a (chosen, rejected) pair of the "
            f"longest sequences ({pair} tokens: twice policy.max_total_sequence_length="
            f"{p.max_total_sequence_length}), and {what} trains a pair's two rows in one micro-batch; fix: "
            f"policy.{name}.{budget_key('train')}={pair} or more"
        )
    return problems
