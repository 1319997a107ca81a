"""Checkpoint directory management: atomic step directories, discovery of the latest one, retention.

Layout (the NVIDIA NeMo RL one)::

    <checkpoint_dir>/step_N/
        config.yaml            the resolved recipe
        training_info.json     counters and metrics, e.g. {"step": N, "val/accuracy": 0.4}
        train_dataloader.pt    dataloader state dict
        rng_state.pt           Python / NumPy / torch RNG states
        policy/...             written by the ``write_policy`` callback (see ``dcp_io.save_policy``)
        manifest.json          every other file's size and SHA-256, written last (see ``manifest``)

A checkpoint is first written to ``tmp_step_N`` and renamed to ``step_N`` only once complete, so
a crash mid-save never leaves a ``step_N`` that looks resumable; an error mid-save (a full disk above all)
removes ``tmp_step_N``, giving its space back, and keeps the checkpoints before it. Where the rename is
not atomic (a GCS FUSE mount copies), the manifest catches what a crash leaves:
:meth:`CheckpointManager.latest` skips a checkpoint whose files do not match it, with a warning naming the
file, and resumes from the newest one that does. A checkpoint saved before rlfleet wrote manifests (no
``manifest.json`` and no ``"manifest"`` key in its ``training_info.json``) is accepted with a warning that
it cannot be verified.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from rlfleet.checkpoint.dcp_io import (
    DCP_METADATA_FILE,
    POLICY_DIR,
    WEIGHTS_DIR,
    barrier,
    capture_rng_state,
    is_rank_zero,
    restore_rng_state,
    torch_load_safe,
    torch_save_checked,
)
from rlfleet.checkpoint.manifest import MANIFEST_FILE, CheckpointError, verify_manifest, write_manifest
from rlfleet.config.metric_names import normalize_metric_name  # the rule config validation uses

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.yaml"
TRAINING_INFO_FILE = "training_info.json"
DATALOADER_FILE = "train_dataloader.pt"
RNG_FILE = "rng_state.pt"
# Key of training_info.json recording that the checkpoint has a manifest (so a missing one is damage).
MANIFEST_KEY = "manifest"

_STEP_RE = re.compile(r"^step_(\d+)$")
_TMP_PREFIX = "tmp_"
_STALE_PREFIX = "stale_"


def step_dir_name(step: int) -> str:
    """``step_N`` directory name for a step."""
    return f"step_{step}"


def is_complete_checkpoint(path: Path) -> bool:
    """True when ``path`` holds ``training_info.json`` and the DCP weights metadata."""
    path = Path(path)
    weights_md = path / POLICY_DIR / WEIGHTS_DIR / DCP_METADATA_FILE
    return (path / TRAINING_INFO_FILE).is_file() and weights_md.is_file()


def verify_checkpoint(path: Path) -> bool:
    """Check that a ``step_N`` directory is complete and its files match its ``manifest.json``.

    Returns:
        True when verified; False for a checkpoint saved before rlfleet wrote manifests, which is accepted
        with a warning that its files cannot be verified.

    Raises:
        CheckpointError: A required file is missing, a file does not match the manifest (missing, truncated,
            altered), or the manifest itself is missing although ``training_info.json`` records it.
    """
    path = Path(path)
    required = [TRAINING_INFO_FILE, f"{POLICY_DIR}/{WEIGHTS_DIR}/{DCP_METADATA_FILE}"]
    missing = [f"{name}: missing" for name in required if not (path / name).is_file()]
    if missing:
        raise CheckpointError(path, missing, f"checkpoint {path} is incomplete:")
    if verify_manifest(path):
        return True
    try:
        info = json.loads((path / TRAINING_INFO_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(
            path, [f"{TRAINING_INFO_FILE}: unreadable ({exc})"], f"checkpoint {path} is corrupt:"
        ) from exc
    if isinstance(info, Mapping) and info.get(MANIFEST_KEY):
        problem = (
            f"{MANIFEST_FILE}: missing, though {TRAINING_INFO_FILE} records one "
            "(the save, or the copy behind its rename, was cut short)"
        )
        raise CheckpointError(path, [problem], f"checkpoint {path} is corrupt:")
    logger.warning(
        "Checkpoint %s has no %s (saved before rlfleet wrote manifests): its files cannot be verified.",
        path,
        MANIFEST_FILE,
    )
    return False


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` (or an error it wraps, as DCP's do) is a full disk (``ENOSPC``)."""
    seen: set[int] = set()
    stack: list[BaseException | None] = [exc]
    while stack:
        err = stack.pop()
        if err is None or id(err) in seen:
            continue
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(err):
            return True
        stack += [err.__cause__, err.__context__]
        failures = getattr(err, "failures", None)  # torch.distributed.checkpoint's CheckpointException
        if isinstance(failures, dict):  # rank -> (exception, traceback summary)
            for failure in failures.values():
                wrapped = failure[0] if isinstance(failure, tuple) and failure else failure
                if isinstance(wrapped, BaseException):
                    stack.append(wrapped)
    return False


def _rng_file_name() -> str:
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return f"rng_state_rank{dist.get_rank()}.pt"
    return RNG_FILE


def _json_default(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.item() if obj.numel() == 1 else obj.tolist()
    if isinstance(obj, np.generic | np.ndarray):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(
        f"training_info value of type {type(obj).__name__} is not JSON-serialisable; "
        "pass numbers, strings, lists or dicts."
    )


def _fsync_dir(path: Path) -> None:
    """Best-effort fsync of a directory so a rename survives power loss (POSIX only)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _metric_value(info: Mapping[str, Any], metric: str) -> float | None:
    """Look up ``metric`` (``a/b``) as a flat key, else as a nested path; None if absent/NaN."""
    value: Any = info.get(metric)
    if value is None:
        node: Any = info
        for part in metric.split("/"):
            node = node.get(part) if isinstance(node, Mapping) else None
        value = node
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return None if math.isnan(value) else float(value)


class CheckpointManager:
    """Writes, finds and prunes ``step_N`` checkpoints under one directory.

    Under ``torch.distributed`` every rank calls :meth:`save` (the ``write_policy`` callback
    performs collective DCP saves); rank 0 writes the small files, renames and prunes.

    Args:
        checkpoint_dir: Directory holding the ``step_N`` subdirectories (created on first save).
        metric_name: Key in ``training_info.json`` used to rank checkpoints (``:`` or ``/``
            separated, e.g. ``val:accuracy``); None ranks by recency.
        higher_is_better: Whether a larger metric value is better.
        keep_top_k: Number of best checkpoints to keep (the one just saved, and any newer one, are
            always kept in addition); None keeps every checkpoint.
    """

    def __init__(
        self,
        checkpoint_dir: str | os.PathLike[str],
        metric_name: str | None = None,
        higher_is_better: bool = True,
        keep_top_k: int | None = None,
    ) -> None:
        if keep_top_k is not None and keep_top_k < 1:
            raise ValueError(f"keep_top_k must be >= 1 or None (keep all), got {keep_top_k}.")
        self.checkpoint_dir = Path(checkpoint_dir)
        self.metric_name = normalize_metric_name(metric_name) if metric_name else None
        self.higher_is_better = higher_is_better
        self.keep_top_k = keep_top_k

    # ------------------------------------------------------------------ discovery

    def _step_dirs(self, *, warn: bool) -> list[tuple[int, Path]]:
        """Every ``step_N`` directory, complete or not, oldest first; ``tmp_``/``stale_`` ones are skipped."""
        if not self.checkpoint_dir.is_dir():
            return []
        found: list[tuple[int, Path]] = []
        for entry in sorted(self.checkpoint_dir.iterdir()):
            if not entry.is_dir():
                continue
            if entry.name.startswith((f"{_TMP_PREFIX}step_", f"{_STALE_PREFIX}step_")):
                if not warn:
                    continue
                logger.warning(
                    "Ignoring unfinished checkpoint directory %s (left by an interrupted save; "
                    "it is never resumed from and may be deleted).",
                    entry,
                )
                continue
            match = _STEP_RE.match(entry.name)
            if match is not None:
                found.append((int(match.group(1)), entry))
        return sorted(found)

    def checkpoints(self, *, warn: bool = True) -> list[tuple[int, Path]]:
        """All complete ``step_N`` checkpoints as ``(step, path)``, oldest first (their files unverified).

        ``tmp_step_*`` (interrupted saves) and incomplete ``step_N`` directories are skipped, with a
        warning when ``warn`` is set; unrelated names are ignored.
        """
        found: list[tuple[int, Path]] = []
        for step, entry in self._step_dirs(warn=warn):
            if not is_complete_checkpoint(entry):
                if not warn:
                    continue
                logger.warning(
                    "Ignoring incomplete checkpoint %s (missing %s or %s/%s/%s).",
                    entry,
                    TRAINING_INFO_FILE,
                    POLICY_DIR,
                    WEIGHTS_DIR,
                    DCP_METADATA_FILE,
                )
                continue
            found.append((step, entry))
        return found

    def latest(self) -> Path | None:
        """The highest-numbered ``step_N`` directory that is complete and matches its manifest.

        A checkpoint that fails (see :func:`verify_checkpoint`) is skipped with a warning naming the file and
        the reason, and the one before it is tried.

        Returns:
            The checkpoint to resume from, or None when there is no ``step_N`` directory at all.

        Raises:
            CheckpointError: ``step_N`` directories exist but none passes; the message lists each and why.
        """
        rejected: list[str] = []
        for _, path in reversed(self._step_dirs(warn=True)):
            try:
                verify_checkpoint(path)
            except CheckpointError as err:
                logger.warning("Skipping checkpoint %s: %s. Trying the one before it.", path, err.reason)
                rejected.append(f"{path.name}: {err.reason}")
                continue
            return path
        if rejected:
            raise CheckpointError(
                self.checkpoint_dir,
                rejected,
                f"none of the {len(rejected)} checkpoint(s) under {self.checkpoint_dir} can be resumed from:",
                fix="fix: restore a good copy of one of them, or move them aside to start the run over",
            )
        return None

    # ------------------------------------------------------------------ saving

    def save(
        self,
        step: int,
        *,
        config_yaml: str,
        training_info: Mapping[str, Any],
        dataloader_state: Mapping[str, Any],
        write_policy: Callable[[Path], None],
    ) -> Path:
        """Write ``step_N`` atomically and apply retention.

        Args:
            step: Training step number (``N`` in ``step_N``).
            config_yaml: The resolved recipe, written verbatim to ``config.yaml``.
            training_info: Counters and metrics; ``"step"`` is set to ``step``.
            dataloader_state: Dataloader ``state_dict()`` (tensors and primitives only).
            write_policy: Called with the temporary step directory; must write ``policy/`` under it
                (e.g. ``lambda d: save_policy(d, model, optimizer, scheduler, tokenizer)``).

        Returns:
            The final ``step_N`` path.
        """
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}.")
        final = self.checkpoint_dir / step_dir_name(step)
        tmp = self.checkpoint_dir / f"{_TMP_PREFIX}{final.name}"
        if is_rank_zero():
            self._prepare_tmp(tmp)
        barrier()
        try:
            write_policy(tmp)
            torch_save_checked(capture_rng_state(), tmp / _rng_file_name())
            barrier()
            if is_rank_zero():
                self._write_metadata(tmp, step, config_yaml, training_info, dataloader_state)
                if not is_complete_checkpoint(tmp):
                    raise RuntimeError(
                        f"write_policy did not write {POLICY_DIR}/{WEIGHTS_DIR}/{DCP_METADATA_FILE} under "
                        f"{tmp}; it must save the policy (e.g. with rlfleet.checkpoint.save_policy)."
                    )
                write_manifest(tmp)  # last: every rank's files are written (barrier / write_policy returned)
        except BaseException as exc:
            if is_rank_zero():  # half a checkpoint is never resumed from: give its space back
                shutil.rmtree(tmp, ignore_errors=True)
            if is_disk_full(exc):
                raise self._disk_full(final, exc) from exc
            raise
        if is_rank_zero():
            self._commit(tmp, final)
            logger.info("Saved checkpoint %s", final)
            self._apply_retention(step)
        barrier()
        return final

    def _disk_full(self, final: Path, exc: BaseException) -> CheckpointError:
        """The error for a save the disk had no room for: what is free, what is kept, how to go on."""
        kept = self.checkpoints(warn=False)
        free = shutil.disk_usage(self.checkpoint_dir).free / 2**30
        where = f"{free:.1f} GiB free under {self.checkpoint_dir}"
        resume = f"resumes from {kept[-1][1]}" if kept else "starts over (no checkpoint was kept)"
        return CheckpointError(
            final,
            [f"the disk is full ({where}; its partial files were removed): {exc}"],
            f"checkpoint {final.name} could not be written:",
            fix=(
                "fix: free space, or set checkpointing.keep_top_k=1 or checkpointing.checkpoint_dir=<a disk "
                f"with room>; running the same command again {resume}"
            ),
        )

    def _prepare_tmp(self, tmp: Path) -> None:
        if tmp.exists():
            logger.warning("Removing stale partial checkpoint %s before saving.", tmp)
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)

    @staticmethod
    def _write_metadata(
        tmp: Path,
        step: int,
        config_yaml: str,
        training_info: Mapping[str, Any],
        dataloader_state: Mapping[str, Any],
    ) -> None:
        (tmp / CONFIG_FILE).write_text(config_yaml, encoding="utf-8")
        torch_save_checked(dict(dataloader_state), tmp / DATALOADER_FILE)
        info = {**training_info, "step": step, MANIFEST_KEY: MANIFEST_FILE}
        text = json.dumps(info, indent=2, sort_keys=True, default=_json_default)
        (tmp / TRAINING_INFO_FILE).write_text(text + "\n", encoding="utf-8")

    def _commit(self, tmp: Path, final: Path) -> None:
        """Rename ``tmp`` to ``final``; an existing ``final`` is moved aside first, then deleted."""
        if final.exists():
            stale = final.with_name(f"{_STALE_PREFIX}{final.name}")
            if stale.exists():
                shutil.rmtree(stale)
            logger.warning("Replacing existing checkpoint %s.", final)
            os.replace(final, stale)
            os.replace(tmp, final)
            shutil.rmtree(stale)
        else:
            os.replace(tmp, final)
        _fsync_dir(self.checkpoint_dir)

    # ------------------------------------------------------------------ retention

    def _rank_key(self, step: int, info: Mapping[str, Any]) -> tuple[int, float, int]:
        """Sort key, best first: metric present before absent, better metric, then newer."""
        value = _metric_value(info, self.metric_name) if self.metric_name else None
        if value is None:
            return (1, 0.0, -step)
        return (0, -value if self.higher_is_better else value, -step)

    def _apply_retention(self, saved_step: int) -> None:
        """Delete all but the ``keep_top_k`` best checkpoints, never ``saved_step`` nor a newer one.

        ``latest()`` (what a resume uses) returns the newest checkpoint that verifies: the one just saved
        (its manifest hashes the bytes on disk), unless a newer one (left by an earlier attempt) passes
        first. Neither is ever deleted here, so a resume always finds what it would pick.
        """
        if self.keep_top_k is None:
            return
        found = self.checkpoints(warn=False)
        if self.metric_name is None:
            ranked = sorted(found, key=lambda item: -item[0])
        else:
            infos = {step: self._training_info_or_empty(path) for step, path in found}
            ranked = sorted(found, key=lambda item: self._rank_key(item[0], infos[item[0]]))
        for step, path in ranked[self.keep_top_k :]:
            if step >= saved_step:
                continue
            logger.info("Removing checkpoint %s (keep_top_k=%d).", path, self.keep_top_k)
            shutil.rmtree(path)

    @classmethod
    def _training_info_or_empty(cls, path: Path) -> dict[str, Any]:
        """``training_info.json``, or ``{}`` (ranks last) when it cannot be read."""
        try:
            return cls.load_training_info(path)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            logger.warning(
                "Ranking checkpoint %s last: its %s is unreadable (%s).", path, TRAINING_INFO_FILE, exc
            )
            return {}

    # ------------------------------------------------------------------ loading

    @staticmethod
    def load_training_info(path: Path) -> dict[str, Any]:
        """Read ``training_info.json`` of a checkpoint step directory."""
        file = Path(path) / TRAINING_INFO_FILE
        if not file.is_file():
            raise FileNotFoundError(f"{file} does not exist; {path} is not a complete checkpoint.")
        with file.open(encoding="utf-8") as handle:
            info: dict[str, Any] = json.load(handle)
        return info

    @staticmethod
    def load_dataloader_state(path: Path) -> dict[str, Any]:
        """Read ``train_dataloader.pt`` of a checkpoint step directory."""
        state: dict[str, Any] = torch_load_safe(Path(path) / DATALOADER_FILE)
        return state

    @staticmethod
    def restore_rng(path: Path) -> None:
        """Restore the RNG states saved in a checkpoint step directory (this rank's file)."""
        path = Path(path)
        file = path / _rng_file_name()
        if not file.is_file() and file.name != RNG_FILE:
            logger.warning("No %s in %s; restoring rank 0's RNG state instead.", file.name, path)
            file = path / RNG_FILE
        restore_rng_state(torch_load_safe(file))
