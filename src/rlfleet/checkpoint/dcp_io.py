"""Policy (model / optimizer / scheduler / tokenizer) and RNG checkpoint I/O.

Model and optimizer states are written with ``torch.distributed.checkpoint`` (DCP) through the
``torch.distributed.checkpoint.state_dict`` helpers, so the same code saves and loads a plain
single-process module (no process group needed) and, later, an FSDP2-sharded one on many ranks.

Layout written under a checkpoint step directory (the NVIDIA NeMo RL layout)::

    policy/weights/__0_0.distcp (+ .metadata)     DCP of {"model": model state dict}
    policy/optimizer/__0_0.distcp (+ .metadata)   DCP of {"optim": optimizer state dict, ...}
    policy/scheduler.pt                           torch.save of the LR scheduler state dict
    policy/tokenizer/                             tokenizer.save_pretrained(...)
    policy/tied_weights.json                      {alias: name} of weights tied to another (if any)

A tied weight (a causal LM's ``lm_head.weight``, the embedding itself) is written once, under the name
``named_parameters()`` gives it first: Gemma 3 270M's 262,144 x 640 embedding is 0.6 GiB of float32 that a
plain state dict would hold twice. ``tied_weights.json`` records the other name, so
:func:`load_model_state_dict` returns every key ``model.state_dict()`` has.
"""

from __future__ import annotations

import io
import json
import logging
import pickle
import random
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from rlfleet.checkpoint.manifest import CheckpointError
from rlfleet.models.lora import has_adapters, is_adapter_key

logger = logging.getLogger(__name__)

POLICY_DIR = "policy"
WEIGHTS_DIR = "weights"
OPTIMIZER_DIR = "optimizer"
SCHEDULER_FILE = "scheduler.pt"
TOKENIZER_DIR = "tokenizer"
TIED_WEIGHTS_FILE = "tied_weights.json"
DCP_METADATA_FILE = ".metadata"

_MODEL_KEY = "model"
_OPTIM_KEY = "optim"
# Whether the optimizer had state when saved. DCP's state-dict helpers initialise an empty
# optimizer with a fake zero-lr step (Adam: step=1, zero moments); restoring that verbatim
# would shift Adam's bias correction, so a never-stepped optimizer is restored empty.
_OPTIM_STEPPED_KEY = "optim_stepped"


def _dist_active() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextmanager
def _dcp_context() -> Iterator[bool]:
    """Yield DCP's ``no_dist`` flag, silencing its "assuming single process" warning when set.

    DCP warns on every single-process save/load even when ``no_dist=True`` is passed explicitly.
    """
    no_dist = not _dist_active()
    with warnings.catch_warnings():
        if no_dist:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield no_dist


def is_rank_zero() -> bool:
    """True in a single process and on global rank 0 of an initialised process group."""
    return not _dist_active() or dist.get_rank() == 0


def barrier() -> None:
    """``dist.barrier()`` when a process group is initialised; a no-op otherwise."""
    if _dist_active():
        dist.barrier()


def policy_dir(path: Path) -> Path:
    """Resolve the ``policy/`` directory of a checkpoint.

    Args:
        path: A checkpoint step directory (``.../step_N``) or its ``policy/`` directory itself.

    Returns:
        The directory holding ``weights/``, ``optimizer/``, ``scheduler.pt`` and ``tokenizer/``.
    """
    path = Path(path)
    if not (path / POLICY_DIR).is_dir() and (path / WEIGHTS_DIR / DCP_METADATA_FILE).is_file():
        return path
    return path / POLICY_DIR


def _require_dcp(directory: Path, what: str) -> None:
    if not (directory / DCP_METADATA_FILE).is_file():
        raise FileNotFoundError(
            f"No {what} checkpoint at {directory} (missing {DCP_METADATA_FILE}). Pass a complete "
            "checkpoint step directory (e.g. CheckpointManager.latest()), not a tmp_step_* or "
            "partially written one."
        )


def torch_save_checked(obj: Any, path: Path) -> None:
    """``torch.save`` ``obj`` to ``path``, first checking it reloads with ``weights_only=True``.

    Checking at save time makes an unloadable object (e.g. a lambda or a custom class inside a
    dataloader state) fail on the first checkpoint rather than hours later on resume.

    Raises:
        TypeError: When ``obj`` holds something other than tensors, containers and primitives.
    """
    buffer = io.BytesIO()
    try:
        torch.save(obj, buffer)
        torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    except (pickle.PicklingError, pickle.UnpicklingError, AttributeError, TypeError) as err:
        raise TypeError(
            f"Cannot checkpoint {path.name}: the object must contain only tensors, dicts, lists, "
            f"tuples, str, int, float, bool and None so it reloads with weights_only=True ({err})."
        ) from err
    path.write_bytes(buffer.getvalue())


def torch_load_safe(path: Path) -> Any:
    """``torch.load(path, weights_only=True)`` on CPU, with a clear error when the file is missing."""
    if not path.is_file():
        raise FileNotFoundError(f"Checkpoint file {path} does not exist; is the checkpoint complete?")
    return torch.load(path, map_location="cpu", weights_only=True)


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """``{alias: name}`` for each parameter reachable under a second name (tied weights), ``name`` being the
    one ``named_parameters()`` lists (e.g. ``{"lm_head.weight": "model.embed_tokens.weight"}``)."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


def _saved_aliases(policy: Path) -> dict[str, str]:
    """The ``{alias: name}`` a checkpoint's ``policy/`` recorded in ``tied_weights.json`` (none: ``{}``)."""
    file = policy / TIED_WEIGHTS_FILE
    return dict(json.loads(file.read_text())) if file.is_file() else {}


def _model_state(model: nn.Module, aliases: dict[str, str]) -> dict[str, Any]:
    """The model's state dict for DCP, each tied weight once."""
    return {k: v for k, v in get_model_state_dict(model).items() if k not in aliases}


def save_policy(
    dir: Path,
    model: nn.Module,
    optimizer: Optimizer | None,
    scheduler: LRScheduler | None,
    tokenizer: Any | None,
) -> None:
    """Write ``policy/`` (weights, optimizer, scheduler, tokenizer) under a checkpoint step dir.

    Under ``torch.distributed`` every rank must call this (DCP saves are collective); scheduler
    and tokenizer files are written by rank 0 only. Without a process group it runs standalone.

    Args:
        dir: The checkpoint step directory (normally ``tmp_step_N`` during a save).
        model: The policy module (plain or FSDP2-sharded).
        optimizer: Its optimizer, or None to save weights only.
        scheduler: Its LR scheduler, or None.
        tokenizer: A Hugging Face tokenizer (``save_pretrained``), or None to skip.
    """
    out = Path(dir) / POLICY_DIR
    aliases = tied_aliases(model)
    with _dcp_context() as no_dist:
        dcp.save({_MODEL_KEY: _model_state(model, aliases)}, checkpoint_id=out / WEIGHTS_DIR, no_dist=no_dist)
        if optimizer is not None:
            stepped = bool(optimizer.state)
            optim_sd = get_optimizer_state_dict(model, optimizer)
            state = {_OPTIM_KEY: optim_sd, _OPTIM_STEPPED_KEY: torch.tensor(stepped)}
            dcp.save(state, checkpoint_id=out / OPTIMIZER_DIR, no_dist=no_dist)
            if not stepped:  # undo DCP's fake initialisation step so training continues unchanged
                optimizer.state.clear()
    if is_rank_zero():
        if aliases:
            (out / TIED_WEIGHTS_FILE).write_text(json.dumps(aliases, indent=2, sort_keys=True) + "\n")
        if scheduler is not None:
            torch_save_checked(scheduler.state_dict(), out / SCHEDULER_FILE)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(out / TOKENIZER_DIR))


def _require_same_adapters(weights: Path, model: nn.Module) -> None:
    """Raises ``CheckpointError`` when the checkpoint and ``model`` disagree on having LoRA adapters:
    DCP loads only the keys asked for, so a mismatch would otherwise load half a policy silently."""
    saved = any(is_adapter_key(k) for k in dcp.FileSystemReader(weights).read_metadata().state_dict_metadata)
    if saved == has_adapters(model):
        return
    wrote, built = ("with", "without") if saved else ("without", "with")
    step_dir = weights.parent.parent
    raise CheckpointError(
        step_dir,
        [f"written by a run {wrote} LoRA adapters, but this policy is built {built} them"],
        f"checkpoint {step_dir} does not fit the policy:",
        fix=f"fix: policy.dtensor_cfg.lora_cfg.enabled={str(saved).lower()} (as in the run that wrote it)",
    )


def load_policy(
    dir: Path,
    model: nn.Module,
    optimizer: Optimizer | None = None,
    scheduler: LRScheduler | None = None,
) -> None:
    """Restore model (and optionally optimizer and scheduler) state in place.

    The optimizer may be freshly constructed (never stepped); its state is rebuilt so the next
    ``step()`` equals that of the uninterrupted run bit for bit.

    Args:
        dir: A checkpoint step directory (or its ``policy/`` directory).
        model: The module to load weights into; same architecture and parameter names as saved.
        optimizer: Optimizer over ``model``'s parameters to restore, or None for weights only.
        scheduler: LR scheduler to restore, or None.

    Raises:
        FileNotFoundError: When a requested part is missing from the checkpoint.
    """
    src = policy_dir(Path(dir))
    _require_dcp(src / WEIGHTS_DIR, "model weights")
    if optimizer is not None:
        _require_dcp(src / OPTIMIZER_DIR, "optimizer")
    if scheduler is not None and not (src / SCHEDULER_FILE).is_file():
        raise FileNotFoundError(f"No LR scheduler state at {src / SCHEDULER_FILE}; pass scheduler=None.")
    _require_same_adapters(src / WEIGHTS_DIR, model)
    with _dcp_context() as no_dist:
        optim_state: dict[str, Any] | None = None
        if optimizer is not None:
            # Built before the weights are loaded: DCP initialises an empty optimizer with a
            # zero-lr step, which must not touch the restored weights.
            optim_state = {
                _OPTIM_KEY: get_optimizer_state_dict(model, optimizer),
                _OPTIM_STEPPED_KEY: torch.tensor(True),
            }
            dcp.load(optim_state, checkpoint_id=src / OPTIMIZER_DIR, no_dist=no_dist)
        # each tied weight once (a checkpoint that holds it twice, as before tied_weights.json, loads too)
        aliases = tied_aliases(model)
        wanted = _model_state(model, aliases)
        # weights the checkpoint holds under another name (tied where it was written, untied here)
        elsewhere = {k: v for k, v in _saved_aliases(src).items() if k in wanted}
        model_state = {_MODEL_KEY: {k: v for k, v in wanted.items() if k not in elsewhere}}
        dcp.load(model_state, checkpoint_id=src / WEIGHTS_DIR, no_dist=no_dist)
        loaded = dict(model_state[_MODEL_KEY])
        for alias, name in elsewhere.items():
            one = {_MODEL_KEY: {name: wanted[alias]}}
            dcp.load(one, checkpoint_id=src / WEIGHTS_DIR, no_dist=no_dist)
            loaded[alias] = one[_MODEL_KEY][name]
        result = set_model_state_dict(model, loaded, options=StateDictOptions(strict=False))
        missing = [k for k in result.missing_keys if k not in aliases]
        if missing or result.unexpected_keys:  # DCP found every key asked for: a bug here, not the file's
            raise RuntimeError(
                f"Loading {src / WEIGHTS_DIR} left keys missing {missing[:5]} / unexpected "
                f"{result.unexpected_keys[:5]}."
            )
        if optimizer is not None and optim_state is not None:
            set_optimizer_state_dict(model, optimizer, optim_state[_OPTIM_KEY])
            if not bool(optim_state[_OPTIM_STEPPED_KEY]):
                optimizer.state.clear()
    if scheduler is not None:
        scheduler.load_state_dict(torch_load_safe(src / SCHEDULER_FILE))


def load_model_state_dict(dir: Path) -> dict[str, torch.Tensor]:
    """Read the saved weights into a plain, full (unsharded) CPU state dict.

    No model instance is needed: tensors are allocated from the DCP metadata with the saved
    shapes and dtypes. Use this in a single process, e.g. for export.

    Args:
        dir: A checkpoint step directory (or its ``policy/`` directory).

    Returns:
        Parameter/buffer name (as in ``model.state_dict()``) to tensor.
    """
    weights = policy_dir(Path(dir)) / WEIGHTS_DIR
    _require_dcp(weights, "model weights")
    metadata = dcp.FileSystemReader(weights).read_metadata()
    state: dict[str, Any] = {
        fqn: torch.empty(meta.size, dtype=meta.properties.dtype)
        for fqn, meta in metadata.state_dict_metadata.items()
        if isinstance(meta, TensorStorageMetadata)
    }
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(state, checkpoint_id=weights, no_dist=True)
    prefix = f"{_MODEL_KEY}."
    plain = {(k[len(prefix) :] if k.startswith(prefix) else k): v for k, v in state.items()}
    for alias, name in _saved_aliases(weights.parent).items():  # sharing the tensor, as a tied model's do
        plain[alias] = plain[name]
    return plain


def capture_rng_state() -> dict[str, Any]:
    """Capture the Python, NumPy (global) and torch (CPU and, if available, CUDA) RNG states.

    The result only holds tensors and primitives, so it round-trips through
    ``torch.load(..., weights_only=True)``.
    """
    name, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "bit_generator": str(name),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Restore RNG states captured by :func:`capture_rng_state`.

    CUDA states are restored when CUDA is available and the device count matches; otherwise a
    warning is logged and CUDA RNG is left as is.
    """
    random.setstate(state["python"])
    np_state = state["numpy"]
    np.random.set_state(
        (
            np_state["bit_generator"],
            np_state["keys"].numpy().astype(np.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])
    cuda_states = state.get("cuda")
    if cuda_states is None or not torch.cuda.is_available():
        return
    if len(cuda_states) != torch.cuda.device_count():
        logger.warning(
            "Not restoring CUDA RNG: checkpoint has %d device state(s) but %d device(s) are visible.",
            len(cuda_states),
            torch.cuda.device_count(),
        )
        return
    torch.cuda.set_rng_state_all(cuda_states)
