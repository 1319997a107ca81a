"""Building the distillation teacher from the config: checked against the student from their files before any
weights load, then started in the trainer's process (one-process runs) or in a Ray actor of its own (runs
on Ray, :mod:`rlfleet.algorithms.distillation.ray_teacher`)."""

from __future__ import annotations

from typing import Protocol

import torch
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from rlfleet.algorithms.distillation.checks import teacher_problems
from rlfleet.algorithms.distillation.teacher import Teacher
from rlfleet.config import MasterConfig
from rlfleet.config.capabilities import uses_ray
from rlfleet.config.errors import ConfigError
from rlfleet.config.layout import ResourceLayout
from rlfleet.config.resolved import teacher_precision
from rlfleet.errors import UserError
from rlfleet.models.loading import ModelSource
from rlfleet.policy.batch import TrainBatch
from rlfleet.policy.microbatch import MicroBatching
from rlfleet.runtime.components import model_source


class TeacherHandle(Protocol):
    """What the distillation loop needs from its teacher, wherever it runs."""

    def topk(
        self, batch: TrainBatch, micro_batching: MicroBatching | int, k: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The teacher's top-k ``(logprobs, ids)`` ``[B, T, k]`` over ``batch``, on the CPU."""
        ...

    def close(self) -> None: ...


def teacher_source(cfg: MasterConfig) -> ModelSource:
    """Where the teacher loads from (``teacher.*``), in its resolved precision."""
    teacher = cfg.teacher
    if teacher is None:
        raise ConfigError("teacher.model_name: distillation needs a teacher; fix: a teacher: block")
    return ModelSource(
        teacher.model_name,
        teacher_precision(cfg).name,
        teacher.gguf_file,
        teacher.tokenizer.name,
        chat_template=teacher.tokenizer.chat_template,
    )


def preflight_teacher(cfg: MasterConfig) -> None:
    """Reads the teacher's and the student's tokenizers and model configs (no weights) and refuses a teacher
    whose vocabulary is not the student's or smaller than ``distillation.topk_logits_k``, or that does not
    load, with the reason and a fix."""
    teacher_tokenizer, teacher_config = _files(teacher_source(cfg), "teacher", "the teacher")
    student_tokenizer, student_config = _files(model_source(cfg), "policy", "the student (the policy)")
    problems = teacher_problems(
        cfg, student_tokenizer, teacher_tokenizer, student_config.vocab_size, teacher_config.vocab_size
    )
    if problems:
        raise ConfigError(problems, header=f"the teacher cannot teach this student ({len(problems)}):")


def _files(source: ModelSource, section: str, what: str) -> tuple[PreTrainedTokenizerBase, PretrainedConfig]:
    """A model's tokenizer and config (no weights), or a ConfigError naming ``section``'s key."""
    try:
        return source.load_tokenizer(), source.load_config()
    except UserError as exc:  # rlfleet's own loading errors say what to fix
        raise ConfigError(f"{section}.model_name={source.model_name!r}: {what} does not load: {exc}") from exc
    except Exception as exc:  # any other loading failure is the user's path or files too
        raise ConfigError(
            f"{section}.model_name={source.model_name!r}: {what} does not load ({type(exc).__name__}: "
            f"{exc}); fix: {section}.model_name=<a directory or hub id with its config and tokenizer> (an "
            "exported checkpoint: `rlfleet export CHECKPOINT OUT`)"
        ) from exc


def start_teacher(cfg: MasterConfig, layout: ResourceLayout) -> TeacherHandle:
    """The teacher in this process, or on a Ray run in a Ray actor of its own. Its top-k is read at
    ``teacher.generation.temperature``: NeMo RL divides a teacher's logits by its own generation temperature
    (its ``teacher:`` block copies the policy's; a block that sets none here reads at 1.0)."""
    source = teacher_source(cfg)  # refuses a recipe without a teacher
    assert cfg.teacher is not None
    temperature = cfg.teacher.generation.temperature
    if uses_ray(cfg, layout=layout):
        from rlfleet.algorithms.distillation.ray_teacher import RayTeacher

        return RayTeacher.start(source, temperature)
    return Teacher(source, temperature)
