"""The checks of what an algorithm trains on, one of the parts of :func:`rlfleet.config.checks.check_config`,
driven by the algorithm's description (``pairs``, ``reward_model``): preference data for an algorithm that
trains on pairs and never for one that does not, the pairs against the batch and the token budgets, a reward
model's loading only where one is trained, and a shipped recipe's data file not written yet. What is an
algorithm's own (DPO's sampled pairs, the reward model's policy section) is in its folder's ``checks``. Each
problem names the key, the value, the constraint and a fix.
"""

from __future__ import annotations

from pathlib import Path

from rlfleet.config.algorithm import AlgorithmSpec
from rlfleet.config.batching import budget_key, recipe_budget, token_budget_section
from rlfleet.config.embedded import GENERATED_DATA
from rlfleet.config.layout import ResourceLayout
from rlfleet.config.preferences import PREFERENCE_DATASETS
from rlfleet.config.schema import MasterConfig
from rlfleet.utils.intmath import round_up


def pair_problems(cfg: MasterConfig, spec: AlgorithmSpec, layout: ResourceLayout) -> list[str]:
    """Everything about preference pairs and reward models that keeps ``cfg`` from running ``spec``'s
    algorithm."""
    problems = _data_problems(cfg, spec) + _generated_data_problems(cfg)
    if cfg.policy.reward_model_cfg.enabled and not spec.reward_model:
        problems.append(
            f"policy.reward_model_cfg.enabled=true loads the model as a reward model (a score head, no "
            f"language-model head), which {spec.name} cannot train or sample from; fix: "
            "policy.reward_model_cfg.enabled=false, or `rlfleet rm` to train a reward model"
        )
    if spec.pairs != "never":
        problems += _pair_problems(cfg, spec.name, layout)
    return problems


def _data_problems(cfg: MasterConfig, spec: AlgorithmSpec) -> list[str]:
    name, preference = cfg.data.dataset_name, cfg.data.dataset_name in PREFERENCE_DATASETS
    if spec.pairs == "always" and not preference:
        return [
            f"data.dataset_name: {name} is a task (prompts and answers), but {spec.name} trains on "
            "preference pairs of a dataset (a chosen and a rejected reply); fix: "
            "data.dataset_name=PreferenceDataset or BinaryPreferenceDataset with "
            "data.train_data_path and data.val_data_path (e.g. `rlfleet data arithmetic-pairs DIR` writes "
            "arithmetic pairs)"
        ]
    if spec.pairs == "never" and preference:
        return [
            f"data.dataset_name: {name} is preference data (chosen and rejected replies), which "
            f"{spec.name} cannot train on; fix: `rlfleet dpo` or `rlfleet rm` on it, or a task dataset for "
            f"{spec.name}"
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
