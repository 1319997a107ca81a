"""On-policy distillation's own config checks, run by :func:`rlfleet.config.checks.check_config`: the
teacher block, the batch arithmetic, and the Ray layout. What needs the teacher's files (its vocabulary
against the student's, ``topk_logits_k`` against it) is :func:`teacher_problems`, run before any weights
load. Each problem names the key, the value, the constraint and a fix.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlfleet.algorithms.distillation.config import TEACHER_KEYS, TEACHER_PLAN_KEYS, TEACHER_REFUSED_KEYS
from rlfleet.config.embedded import GENERATED_MODELS
from rlfleet.config.layout import ResourceLayout
from rlfleet.config.schema import MasterConfig, PolicyConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def distillation_problems(cfg: MasterConfig, layout: ResourceLayout) -> list[str]:
    """Everything in the recipe alone that keeps ``cfg`` from running distillation (its description's
    ``checks``; distillation keys set for another algorithm are not used, so they are not checked)."""
    teacher, problems = cfg.teacher, []
    if teacher is None or not teacher.model_name:
        return [
            "teacher.model_name: distillation needs a teacher (a teacher: block in the policy's schema, "
            "NeMo RL's key); fix: teacher.model_name=<hub id or directory of the teacher> (e.g. a GRPO "
            "run's exported checkpoint)"
        ]
    written_by = GENERATED_MODELS.get(str(Path(teacher.model_name)))
    if written_by and not Path(teacher.model_name).is_dir():
        problems.append(
            f"teacher.model_name={teacher.model_name}: that model is not written yet; {written_by}; or set "
            "teacher.model_name to a model of yours"
        )
    if teacher.dtensor_cfg.lora_cfg.enabled:
        problems.append(
            "teacher.dtensor_cfg.lora_cfg.enabled=true: the teacher is not trained, so adapters on it would "
            "never learn; fix: teacher.dtensor_cfg.lora_cfg.enabled=false (LoRA on the student is "
            "policy.dtensor_cfg.lora_cfg)"
        )
    if teacher.reward_model_cfg.enabled:
        problems.append(
            "teacher.reward_model_cfg.enabled=true: a reward model has no vocabulary distribution to "
            "distil from; fix: teacher.reward_model_cfg.enabled=false"
        )
    problems += unused_teacher_keys(cfg)
    d, batch = cfg.distillation, cfg.policy.train_global_batch_size
    samples = d.num_prompts_per_step * d.num_generations_per_prompt
    if samples % batch:
        problems.append(
            f"distillation.num_prompts_per_step * distillation.num_generations_per_prompt = "
            f"{d.num_prompts_per_step} * {d.num_generations_per_prompt} = {samples} sequences per step, "
            f"which policy.train_global_batch_size={batch} does not divide; fix: "
            f"policy.train_global_batch_size={_largest_divisor_at_most(samples, batch)} (a divisor of "
            f"{samples}) or distillation.num_prompts_per_step to a multiple of {batch}"
        )
    return problems


def unused_teacher_keys(cfg: MasterConfig) -> list[str]:
    """A problem for each key of the ``teacher:`` block that the teacher does not read and that holds neither
    the schema's default nor the policy's value: NeMo RL's recipes copy the policy's block into the teacher's
    (a copy passes), but a value set for the teacher alone would change nothing here, so it is refused
    rather than ignored."""
    if cfg.teacher is None:
        return []
    read = (*TEACHER_KEYS, *TEACHER_PLAN_KEYS, *TEACHER_REFUSED_KEYS)
    default, policy = _leaves(PolicyConfig().model_dump()), _leaves(cfg.policy.model_dump())
    problems = []
    for key, value in _leaves(cfg.teacher.model_dump()).items():
        if any(key == k or key.startswith(k + ".") for k in read):
            continue
        if value in (default.get(key), policy.get(key)):
            continue
        why = (
            "the teacher does not sample (it scores the student's samples at teacher.generation.temperature)"
            if key.startswith("generation.")
            else "the teacher is frozen and computes in one process or one Ray actor of its own"
        )
        reads = ", ".join(TEACHER_KEYS)
        problems.append(
            f"teacher.{key}={value!r}: not used: {why}; a teacher reads teacher.{{{reads}}}, and other keys "
            f"are accepted at their default or at the policy's value ({policy.get(key)!r}, a copy of NeMo "
            f"RL's policy block); fix: remove teacher.{key} from the recipe"
        )
    return problems


def _leaves(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a.b": value}`` for every leaf of a nested mapping (a ``model_dump``)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping) and value:
            out.update(_leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _largest_divisor_at_most(n: int, limit: int) -> int:
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


def teacher_problems(
    cfg: MasterConfig,
    student: PreTrainedTokenizerBase,
    teacher: PreTrainedTokenizerBase,
    student_vocabulary: int,
    teacher_vocabulary: int,
) -> list[str]:
    """The teacher against the student, from their tokenizers and their models' vocabulary sizes (the
    rows of their output layers), before any weights load: the same tokens with the same ids (NeMo RL's
    check; the student is read at the teacher's token ids), and ``topk_logits_k`` within the vocabulary."""
    problems = []
    ours, theirs = student.get_vocab(), teacher.get_vocab()
    if ours != theirs or student_vocabulary != teacher_vocabulary:
        differ = sorted(
            (t for t in ours.keys() | theirs.keys() if ours.get(t) != theirs.get(t)),
            key=lambda t: (min(ours.get(t, 1 << 62), theirs.get(t, 1 << 62)), t),  # by the lower id
        )
        shown = ", ".join(f"{t!r}: student {ours.get(t)}, teacher {theirs.get(t)}" for t in differ[:5])
        more = f" and {len(differ) - 5} more" if len(differ) > 5 else ""
        sizes = f"output layers of {student_vocabulary} and {teacher_vocabulary} rows"
        name = cfg.teacher.model_name if cfg.teacher else None
        problems.append(
            f"teacher.model_name={name!r}: the teacher's vocabulary "
            f"is not the student's ({len(differ)} token(s) differ: {shown or 'none'}{more}; {sizes}); the "
            "student is read at the teacher's token ids, so they must mean the same tokens; fix: a teacher "
            "of the student's family (the same tokenizer)"
        )
    k, vocabulary = cfg.distillation.topk_logits_k, min(student_vocabulary, teacher_vocabulary)
    if k > vocabulary:
        problems.append(
            f"distillation.topk_logits_k={k} is larger than the vocabulary ({vocabulary} tokens); fix: "
            f"distillation.topk_logits_k={min(64, vocabulary)} (NeMo RL's default is 64)"
        )
    return problems
