"""The disk a run's checkpoints take, counted before any model loads; a full disk mid-save loses nothing."""

from __future__ import annotations

import errno
from collections import namedtuple
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem

from rlfleet.checkpoint import CheckpointError, CheckpointManager, save_policy, space
from rlfleet.checkpoint.manager import is_disk_full
from rlfleet.checkpoint.space import (
    checkpoint_bytes,
    checkpoints_to_write,
    describe_disk,
    disk_plan,
    disk_problems,
    ensure_disk,
    export_bytes,
    pipeline_problems,
    run_steps,
    saves_between,
)
from rlfleet.cli import main
from rlfleet.config import ConfigError, load_recipe, resolve_recipe_path
from rlfleet.config.layout import resource_layout
from rlfleet.memory.estimate import GIB
from rlfleet.runtime import loop

GEMMA_GRPO = "grpo-gemma3-270m-gsm8k-cpu"
Usage = namedtuple("Usage", "total used free")


def gemma(tmp_path: Path, *overrides: str) -> Any:
    return load_recipe(
        resolve_recipe_path(GEMMA_GRPO), [f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}", *overrides]
    )


def free_disk(monkeypatch: pytest.MonkeyPatch, gib: float) -> None:
    monkeypatch.setattr(space.shutil, "disk_usage", lambda path: Usage(1000 * GIB, 0, int(gib * GIB)))


@pytest.mark.parametrize(
    ("start", "stop", "period", "saves"),
    [
        (0, 16, 10, 2),
        (0, 20, 10, 2),
        (10, 16, 10, 1),
        (16, 16, 10, 0),
        (0, 3, 1, 3),
        (5, 25, 10, 3),
        (0, 4, 10, 1),
    ],
)
def test_saves_are_every_period_and_at_the_last_step(start: int, stop: int, period: int, saves: int) -> None:
    assert saves_between(start, stop, period) == saves
    # the loop's own rule (runtime.loop.should_checkpoint), step by step
    assert saves == sum(1 for s in range(start + 1, stop + 1) if s % period == 0 or s == stop)


@pytest.mark.parametrize(
    ("keep", "saves", "existing", "written"),
    [
        (2, 2, 0, 2),  # both kept
        (2, 5, 0, 3),  # two kept, the third written before pruning
        (2, 3, 2, 1),  # a resumed run: one more beside the two it has
        (1, 10, 5, 1),  # more than kept already there: still one written before any is pruned
        (None, 4, 3, 4),  # keep_top_k null keeps every one
        (3, 0, 1, 0),  # nothing left to save
    ],
)
def test_checkpoints_on_disk_at_the_peak(keep: int | None, saves: int, existing: int, written: int) -> None:
    assert checkpoints_to_write(keep, saves, existing) == written


def test_the_estimate_matches_a_measured_gemma_checkpoint() -> None:
    """Gemma 3 270M after one SFT step (`rlfleet sft sft-gemma3-270m-gsm8k-cpu sft.max_num_steps=1`):
    3,252,377,535 bytes on disk (weights 1,072,835,053; AdamW 2,146,129,194; tokenizer 33,376,081). With the
    tied embedding written twice it would be 0.63 GiB more."""
    estimate = checkpoint_bytes(268_098_176, 268_098_176, optimizer_state_bytes=8, vocab_size=262_144)
    assert 0.97 < estimate / 3_252_377_535 < 1.03


def test_a_recipe_whose_checkpoints_fit_passes_and_plan_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    free_disk(monkeypatch, 50)
    cfg = gemma(tmp_path)  # keep_top_k 2, a save every 10 of 16 steps
    plan = disk_plan(cfg, run_steps(cfg, "grpo"))
    assert plan is not None and (plan.saves, plan.existing, plan.to_write) == (2, 0, 2)
    assert disk_problems(cfg, 16) == []
    line = describe_disk(cfg, 16)
    assert (
        line is not None and "2 to write, up to 2 on disk at once" in line and "fits: 50.0 GiB free" in line
    )


def test_a_run_whose_checkpoints_would_fill_the_disk_is_refused_with_the_fixes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    free_disk(monkeypatch, 8)
    cfg = gemma(tmp_path, "grpo.max_num_steps=30")  # three saves: two kept and the third written
    [problem] = disk_problems(cfg, 30)
    assert "need about 9.1 GiB (3 of 3.0 GiB: keep_top_k=2 plus the one being written)" in problem
    assert "8.0 GiB is free" in problem
    assert "fix: checkpointing.keep_top_k=1 or checkpointing.checkpoint_dir=" in problem
    with pytest.raises(ConfigError, match="would not fit on the disk"):
        ensure_disk(cfg, 30)
    assert not disk_problems(gemma(tmp_path, "checkpointing.keep_top_k=1"), 30)  # the fix it names holds
    assert not disk_problems(gemma(tmp_path, "checkpointing.enabled=false"), 30)
    monkeypatch.setenv("RLFLEET_DISK_CHECK", "off")
    assert not disk_problems(cfg, 30)


def test_keeping_fewer_is_not_offered_where_it_would_not_help(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    free_disk(monkeypatch, 5)  # two saves, both kept: 6.0 GiB
    [problem] = disk_problems(gemma(tmp_path), 16)
    assert "(2 of 3.0 GiB: every save kept, keep_top_k=2)" in problem
    assert "keep_top_k=1" not in problem.split("fix:")[1]
    assert "fix: checkpointing.checkpoint_dir=<a disk with room> or free space" in problem


def test_a_resumed_run_counts_the_checkpoints_it_already_has(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    free_disk(monkeypatch, 50)
    cfg = gemma(tmp_path)
    manager = CheckpointManager(tmp_path / "ckpt", None, True, 2)
    linear = nn.Linear(2, 2)
    save_step(manager, 10, lambda d: save_policy(d, linear, None, None, None))
    plan = disk_plan(cfg, 16)
    assert plan is not None and (plan.saves, plan.existing, plan.to_write) == (1, 1, 1)


def test_the_run_refuses_before_reading_data_or_loading_a_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    free_disk(monkeypatch, 1)

    def started(*args: object, **kwargs: object) -> None:
        raise AssertionError("the run started work before checking the disk")

    monkeypatch.setattr(loop, "load_task", started)
    monkeypatch.setattr(loop, "build_policy", started)
    cfg = gemma(tmp_path)
    with pytest.raises(ConfigError, match="checkpoints would not fit on the disk"):
        loop.start_run(
            cfg,
            resource_layout(cfg),
            seed=0,
            keep_reference=True,
            max_val_samples=1,
            batch_size=1,
            max_num_steps=16,
            max_num_epochs=1,
        )


def test_validate_refuses_it_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    free_disk(monkeypatch, 1)  # SmolLM2 (installed by the set-up; Gemma's GRPO model is built by its demo)
    assert main(["validate", "grpo-smollm2-135m-gsm8k-cpu", f"checkpointing.checkpoint_dir={tmp_path}"]) == 2
    assert "checkpoints would not fit on the disk" in capsys.readouterr().err


def save_step(manager: CheckpointManager, step: int, write_policy: Any) -> Path:
    return manager.save(
        step, config_yaml="{}", training_info={}, dataloader_state={"epoch": 0}, write_policy=write_policy
    )


def test_a_full_disk_mid_save_removes_the_partial_files_and_keeps_the_last_checkpoint(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, None, True, 2)
    linear = nn.Linear(2, 2)
    good = save_step(manager, 10, lambda d: save_policy(d, linear, None, None, None))

    def fills_the_disk(step_dir: Path) -> None:
        save_policy(step_dir, linear, None, None, None)
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(CheckpointError) as err:
        save_step(manager, 20, fills_the_disk)
    message = str(err.value)
    assert "step_20 could not be written" in message and "the disk is full" in message
    assert f"resumes from {good}" in message and "checkpointing.keep_top_k=1" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_10"]  # no tmp_step_20 left to fill the disk
    assert manager.latest() == good


def test_another_error_mid_save_is_raised_as_is_and_leaves_no_partial_files(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, None, True, None)

    def breaks(step_dir: Path) -> None:
        (step_dir / "policy").mkdir()
        raise ValueError("a bug in write_policy")

    with pytest.raises(ValueError, match="a bug in write_policy"):
        save_step(manager, 1, breaks)
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_is_recognised_inside_the_errors_that_wrap_it() -> None:
    enospc = OSError(errno.ENOSPC, "No space left on device")
    assert is_disk_full(enospc)
    assert is_disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert is_disk_full(RuntimeError("[enforce fail at inline_container.cc] No space left on device"))
    assert is_disk_full(CheckpointException("save failed", {0: (enospc, None)}))  # DCP's, per rank
    try:
        try:
            raise enospc
        except OSError as inner:
            raise RuntimeError("writing failed") from inner
    except RuntimeError as outer:
        assert is_disk_full(outer)
    assert not is_disk_full(OSError(errno.EACCES, "Permission denied"))
    assert not is_disk_full(ValueError("bad"))


def test_dcp_itself_reports_the_full_disk_so_it_is_recognised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a real save raises when the disk fills: DCP's writer hits ENOSPC inside its own machinery."""
    real = FileSystem.create_stream

    @contextmanager
    def full_disk(self: FileSystem, path: Any, mode: str) -> Iterator[Any]:
        if "w" in mode and str(path).endswith(".distcp"):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        with real(self, path, mode) as stream:
            yield stream

    monkeypatch.setattr(FileSystem, "create_stream", full_disk)
    with pytest.raises(BaseException) as err:  # DCP's CheckpointException is a BaseException
        dcp.save({"w": nn.Linear(2, 2).weight.detach()}, checkpoint_id=tmp_path / "w", no_dist=True)
    assert is_disk_full(err.value)


def demo_stages(out: Path) -> list[tuple[Any, int | None]]:
    sft = load_recipe(
        resolve_recipe_path("sft-gemma3-270m-gsm8k-cpu"), [f"checkpointing.checkpoint_dir={out / 'sft'}"]
    )
    grpo = gemma(out)
    return [(sft, run_steps(sft, "sft")), (grpo, run_steps(grpo, "grpo"))]


def test_a_pipeline_counts_what_each_stage_keeps_while_the_next_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`make train-gemma3`: SFT (two checkpoints at once, one kept), its exported float32 model (1.0 GiB),
    then GRPO (two kept): 3.0 + 1.0 + 6.1 GiB at GRPO's peak, where each stage alone needs 6.1."""
    stages = demo_stages(tmp_path)
    export = export_bytes(stages[0][0])
    assert abs(export / GIB - 1.0) < 0.01  # policy.precision auto: the float32 masters
    free_disk(monkeypatch, 10)
    assert all(not disk_problems(cfg, steps) for cfg, steps in stages)  # each stage alone fits
    [problem] = pipeline_problems(stages, [export], fix="--out elsewhere")
    assert "need about 10.1 GiB at their peak" in problem and "10.0 GiB is free" in problem
    assert "6.1 GiB while it runs, 3.0 GiB kept" in problem and "then 1.0 GiB of exported weights" in problem
    assert "fix: --out elsewhere" in problem
    assert not pipeline_problems(stages, [0], fix="")  # the model already exported: 9.1 GiB
    free_disk(monkeypatch, 11)
    assert not pipeline_problems(stages, [export], fix="")


def test_the_gemma_demo_refuses_before_its_sft_stage_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rlfleet import demo

    def started(*args: object, **kwargs: object) -> None:
        raise AssertionError("a stage started before the disk was checked")

    monkeypatch.setattr(demo, "sft_train", started)
    monkeypatch.setattr(demo, "grpo_train", started)
    free_disk(monkeypatch, 10)
    with pytest.raises(ConfigError, match="stages' checkpoints would not fit on the disk") as err:
        demo.run_demo(tmp_path / "out", task="gemma3")
    assert f"--out <a directory on a disk with room> (now {tmp_path / 'out'})" in str(err.value)
