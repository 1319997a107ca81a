"""Disk space for a run's checkpoints: what they will take, checked before any model loads.

A checkpoint holds the float32 master weights (a tied embedding once), the optimizer's state (AdamW: two
float32 moments per trained parameter), the tokenizer, and a few small files (scheduler, RNG, dataloader,
recipe, manifest). A run keeps ``checkpointing.keep_top_k`` of them and writes the next one before pruning,
so at its peak ``keep_top_k + 1`` are on disk at once (every one it saves, with ``keep_top_k: null``).
The estimate against checkpoints on disk: ``tests/unit/test_checkpoint_space.py``.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rlfleet.checkpoint.manager import CheckpointManager
from rlfleet.config.algorithm import Algorithm, algorithm_settings
from rlfleet.config.errors import ConfigError
from rlfleet.config.schema import MasterConfig
from rlfleet.memory.estimate import gib
from rlfleet.memory.planner import OPTIMIZER_STATE_BYTES, parameter_counts, switched_off, trains_here

# the tokenizer's files grow with its vocabulary (Gemma 3's 262,144 entries: 33,376,081 bytes, SmolLM2's
# 49,152: 3.6 MB), and the small files beside the weights
TOKENIZER_BYTES_PER_ENTRY = 128
SMALL_FILES_BYTES = 2**20
# RLFLEET_DISK_CHECK=off starts a run whose checkpoints would not fit on the disk (it fails at a save)
SKIP_ENV = "RLFLEET_DISK_CHECK"


def checkpoint_bytes(
    parameters: int, trainable: int, optimizer_state_bytes: int, vocab_size: int, lora: bool = False
) -> int:
    """One checkpoint: float32 weights (the base and, with LoRA, the adapters), the optimizer's state per
    trained parameter, the tokenizer and the small files."""
    weights = 4 * (parameters + (trainable if lora else 0))
    files = TOKENIZER_BYTES_PER_ENTRY * vocab_size + SMALL_FILES_BYTES
    return weights + optimizer_state_bytes * trainable + files


def saves_between(start: int, stop: int, period: int) -> int:
    """Checkpoints a run writes from step ``start`` (excluded) to ``stop``: every ``period`` steps and at
    ``stop``."""
    if stop <= start:
        return 0
    return stop // period - start // period + (1 if stop % period else 0)


def checkpoints_to_write(keep_top_k: int | None, saves: int, existing: int) -> int:
    """How many checkpoints the run adds to the ``existing`` ones at its peak on disk: each save writes the
    new one before pruning to ``keep_top_k`` (None: every save stays)."""
    if saves == 0:
        return 0
    if keep_top_k is None:
        return saves
    return max(1, min(saves, keep_top_k + 1 - existing))


def nearest_existing(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists (where a directory not yet made would be)."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


@dataclass(frozen=True)
class DiskPlan:
    directory: Path
    per_checkpoint: int  # bytes
    saves: int  # checkpoints the run writes from here (an unbounded run's counted as one)
    existing: int  # step_N directories already there (a resumed run's)
    to_write: int  # checkpoints on disk at the peak beyond the existing ones
    free: int | None  # bytes free where they go; None where the run saves elsewhere (a cluster)

    @property
    def needed(self) -> int:
        return self.to_write * self.per_checkpoint


def disk_plan(cfg: MasterConfig, max_num_steps: int | None) -> DiskPlan | None:
    """The disk the run's checkpoints take, or None when it saves none or the recipe gives no
    ``policy.architecture`` to count parameters from. ``max_num_steps``: None when only the epochs bound it
    (counted as one more save)."""
    ckpt, arch = cfg.checkpointing, cfg.policy.architecture
    if not ckpt.enabled or arch is None:
        return None
    parameters, trainable = parameter_counts(cfg)
    optimizer = OPTIMIZER_STATE_BYTES.get(cfg.policy.optimizer.name, 8)
    lora = cfg.policy.dtensor_cfg.lora_cfg.enabled
    directory = Path(ckpt.checkpoint_dir)
    steps = [step for step, _ in CheckpointManager(directory).checkpoints(warn=False)]
    start = steps[-1] if steps else 0
    saves = 1 if max_num_steps is None else saves_between(start, max_num_steps, ckpt.save_period)
    free = shutil.disk_usage(nearest_existing(directory)).free if trains_here(cfg) else None
    return DiskPlan(
        directory=directory,
        per_checkpoint=checkpoint_bytes(parameters, trainable, optimizer, arch.vocab_size, lora),
        saves=saves,
        existing=len(steps),
        to_write=checkpoints_to_write(ckpt.keep_top_k, saves, len(steps)),
        free=free,
    )


def run_steps(cfg: MasterConfig, algorithm: Algorithm) -> int | None:
    """The algorithm's ``max_num_steps``; None for no limit (``rm.max_num_steps=-1``: the epochs decide)."""
    return algorithm_settings(cfg, algorithm).max_num_steps


def disk_problems(cfg: MasterConfig, max_num_steps: int | None) -> list[str]:
    """One line when the run's checkpoints would not fit on the disk they go to (none when they fit, or
    cannot be counted, or the check is off)."""
    plan = disk_plan(cfg, max_num_steps) if not switched_off(SKIP_ENV) else None
    if plan is None or plan.free is None or plan.needed <= plan.free:
        return []
    keep = cfg.checkpointing.keep_top_k
    if keep is None:
        why = "keep_top_k=null keeps all"
    elif plan.existing + plan.saves <= keep:
        why = f"every save kept, keep_top_k={keep}"
    else:
        why = f"keep_top_k={keep} plus the one being written"
    fixes = ["checkpointing.checkpoint_dir=<a disk with room>", "free space"]
    one_kept = checkpoints_to_write(1, plan.saves, plan.existing) * plan.per_checkpoint
    if keep != 1 and one_kept <= plan.free:
        fixes.insert(0, "checkpointing.keep_top_k=1")
    return [
        f"disk: the run's checkpoints need about {gib(plan.needed)} ({plan.to_write} of "
        f"{gib(plan.per_checkpoint)}: {why}) under {plan.directory}, but {gib(plan.free)} is free there; "
        f"fix: {' or '.join(fixes)} ({SKIP_ENV}=off to try anyway)"
    ]


def describe_disk(cfg: MasterConfig, max_num_steps: int | None) -> str | None:
    """``rlfleet plan``'s line on the checkpoints' disk space (None when none are saved or counted)."""
    plan = disk_plan(cfg, max_num_steps)
    if plan is None:
        return None
    peak = plan.existing + plan.to_write
    text = (
        f"{gib(plan.per_checkpoint)} each; {plan.saves} to write, up to {peak} on disk at once "
        f"({gib(plan.needed)} more than now) under {plan.directory}"
    )
    if plan.free is None:
        return text + " (not compared: the run saves on its cluster)"
    verdict = "fits" if plan.needed <= plan.free else "does NOT fit: `validate` and the run refuse it"
    return text + f"; {verdict}: {gib(plan.free)} free there"


def kept_after(plan: DiskPlan, keep_top_k: int | None) -> int:
    """Bytes a run's new checkpoints still take once it has ended (``keep_top_k`` of them, or every one)."""
    total = plan.existing + plan.saves
    kept = total if keep_top_k is None else min(keep_top_k, total)
    return max(0, kept - plan.existing) * plan.per_checkpoint


def export_bytes(cfg: MasterConfig) -> int:
    """The weights ``export_hf`` writes for a run of ``cfg``: in ``policy.precision`` when it names a dtype,
    float32 (the masters) for ``auto``; 0 without ``policy.architecture``."""
    if cfg.policy.architecture is None:
        return 0
    return {"bfloat16": 2, "float16": 2}.get(cfg.policy.precision, 4) * parameter_counts(cfg)[0]


def pipeline_problems(
    stages: Sequence[tuple[MasterConfig, int | None]],
    between: Sequence[int] = (),
    fix: str = "checkpointing.keep_top_k=1, fewer saves, or free space",
) -> list[str]:
    """One line when runs made one after another (``rlfleet demo``: SFT, the exported model, GRPO) would
    fill their disk: each stage's kept checkpoints, and the ``between[i]`` bytes written after stage ``i``,
    stay on disk while the later stages run. Checked only where every stage saves on the same file system
    (each run still checks its own at its start)."""
    plans = [(disk_plan(cfg, steps), cfg) for cfg, steps in stages] if not switched_off(SKIP_ENV) else []
    counted = [(plan, cfg) for plan, cfg in plans if plan is not None and plan.free is not None]
    devices = {nearest_existing(plan.directory).stat().st_dev for plan, _ in counted}
    if not counted or len(devices) > 1:
        return []
    held = peak = 0
    parts: list[str] = []
    for i, (plan, cfg) in enumerate(counted):
        peak = max(peak, held + plan.needed)
        kept = kept_after(plan, cfg.checkpointing.keep_top_k)
        parts.append(f"{plan.directory}: {gib(plan.needed)} while it runs, {gib(kept)} kept")
        held += kept
        if i < len(between) and between[i]:
            held += between[i]
            parts.append(f"then {gib(between[i])} of exported weights")
    free = counted[0][0].free
    assert free is not None
    if peak <= free:
        return []
    return [
        f"disk: the stages need about {gib(peak)} at their peak, what each keeps staying while the next "
        f"runs ({'; '.join(parts)}), but {gib(free)} is free there; fix: {fix} "
        f"({SKIP_ENV}=off to try anyway)"
    ]


def ensure_pipeline_disk(
    stages: Sequence[tuple[MasterConfig, int | None]], between: Sequence[int], fix: str
) -> None:
    """Raises ``ConfigError`` when ``pipeline_problems`` finds any."""
    problems = pipeline_problems(stages, between, fix)
    if problems:
        raise ConfigError(problems, header="the stages' checkpoints would not fit on the disk:")


def ensure_disk(cfg: MasterConfig, max_num_steps: int | None) -> None:
    """Raises ``ConfigError`` when the run's checkpoints would not fit on their disk."""
    problems = disk_problems(cfg, max_num_steps)
    if problems:
        raise ConfigError(problems, header="the run's checkpoints would not fit on the disk:")
