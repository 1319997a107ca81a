"""Export an rlfleet (DCP) checkpoint to a Hugging Face ``save_pretrained`` directory."""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import yaml
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from rlfleet.checkpoint.dcp_io import TOKENIZER_DIR, load_model_state_dict, policy_dir
from rlfleet.checkpoint.manager import CONFIG_FILE, is_complete_checkpoint, verify_checkpoint
from rlfleet.models.loading import DTYPES, drop_gguf_config, resolve_model_path

logger = logging.getLogger(__name__)


def build_model_from_name(
    model_name: str,
    *,
    gguf_file: str | None = None,
    trust_remote_code: bool = False,
) -> PreTrainedModel:
    """Build a randomly initialised causal LM with the architecture of ``model_name``.

    Only the config is read; no weights are downloaded or loaded.

    Args:
        model_name: Hugging Face hub id or local directory holding a ``config.json``.
        gguf_file: A GGUF file inside ``model_name`` whose architecture to use (the config keeps
            no GGUF record: the exported model is a plain one).
        trust_remote_code: Allow custom modelling code from the model repository.
    """
    config_kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    if gguf_file is not None:
        config_kwargs["gguf_file"] = gguf_file
    try:
        config = AutoConfig.from_pretrained(model_name, **config_kwargs)
    except OSError as err:
        raise FileNotFoundError(
            f"Cannot read the model config of {model_name!r} (from the checkpoint's config.yaml "
            "policy.model_name). Make the base model directory or hub id reachable (set HF_HOME or "
            "HF_HUB_OFFLINE=1 with a populated cache) and retry."
        ) from err
    if gguf_file is not None:
        drop_gguf_config(config)
    return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)


def _require_complete(checkpoint_path: Path) -> None:
    if is_complete_checkpoint(checkpoint_path) and (checkpoint_path / CONFIG_FILE).is_file():
        return
    hint = ""
    if checkpoint_path.is_dir() and any(p.name.startswith("step_") for p in checkpoint_path.iterdir()):
        hint = " It looks like a checkpoint root; pass one of its step_N directories instead."
    raise FileNotFoundError(
        f"{checkpoint_path} is not a complete rlfleet checkpoint: expected config.yaml, "
        f"training_info.json and policy/weights/.metadata (written by CheckpointManager.save).{hint}"
    )


def _model_name_from_config(checkpoint_path: Path) -> tuple[str, str | None, str | None]:
    """``(policy.model_name, policy.gguf_file, policy.precision)`` of the recipe saved with the checkpoint."""
    with (checkpoint_path / CONFIG_FILE).open(encoding="utf-8") as handle:
        recipe = yaml.safe_load(handle) or {}
    policy = recipe.get("policy") if isinstance(recipe, dict) else None
    model_name = policy.get("model_name") if isinstance(policy, dict) else None
    if not isinstance(model_name, str) or not model_name:
        raise ValueError(
            f"{checkpoint_path / CONFIG_FILE} has no policy.model_name; the recipe must name the base "
            "model whose architecture the checkpoint was trained from."
        )
    gguf_file = policy.get("gguf_file") if isinstance(policy, dict) else None
    precision = policy.get("precision") if isinstance(policy, dict) else None
    return resolve_model_path(model_name), gguf_file, precision if precision in DTYPES else None


def _dominant_float_dtype(state_dict: dict[str, torch.Tensor]) -> torch.dtype | None:
    counts = Counter(t.dtype for t in state_dict.values() if t.is_floating_point())
    return counts.most_common(1)[0][0] if counts else None


def _load_weights(model: PreTrainedModel, state_dict: dict[str, torch.Tensor], model_name: str) -> None:
    dtype = _dominant_float_dtype(state_dict)
    if dtype is not None:
        model.to(dtype)
    result = model.load_state_dict(state_dict, strict=False)
    # A tied weight (lm_head.weight sharing embed_tokens.weight) may be saved under one name only.
    current = model.state_dict()
    loaded_ptrs = {current[k].data_ptr() for k in state_dict if k in current}
    missing = [k for k in result.missing_keys if current[k].data_ptr() not in loaded_ptrs]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"Checkpoint weights do not match the architecture of {model_name!r}: "
            f"missing {missing[:5]} ({len(missing)} total), unexpected "
            f"{result.unexpected_keys[:5]} ({len(result.unexpected_keys)} total). Check that "
            "policy.model_name in config.yaml is the model the checkpoint was trained from."
        )


def export_hf(checkpoint_path: Path, out_dir: Path) -> Path:
    """Convert a checkpoint step directory to a Hugging Face model directory.

    The architecture comes from ``policy.model_name`` in the checkpoint's ``config.yaml``; the
    weights from ``policy/weights`` (DCP); the tokenizer from ``policy/tokenizer`` when present.
    The result loads with ``AutoModelForCausalLM.from_pretrained(out_dir)`` (safetensors). Checkpoints
    hold float32 master weights; the export is written in the run's ``policy.precision`` (its compute
    dtype: a bfloat16 run exports bfloat16, half the size).

    Args:
        checkpoint_path: A complete ``step_N`` directory.
        out_dir: Destination directory (created if needed; existing files are overwritten).

    Returns:
        ``out_dir``.

    Raises:
        FileNotFoundError: ``checkpoint_path`` is not a complete checkpoint.
        CheckpointError: Its files do not match its ``manifest.json`` (truncated, missing or altered).
        ValueError: The recipe lacks ``policy.model_name`` or the weights do not fit its architecture.
    """
    checkpoint_path = Path(checkpoint_path)
    out_dir = Path(out_dir)
    _require_complete(checkpoint_path)
    verify_checkpoint(checkpoint_path)
    model_name, gguf_file, precision = _model_name_from_config(checkpoint_path)
    state_dict = load_model_state_dict(checkpoint_path)
    model = build_model_from_name(model_name, gguf_file=gguf_file)
    _load_weights(model, state_dict, model_name)
    if precision is not None:
        model.to(DTYPES[precision])
    out_dir.mkdir(parents=True, exist_ok=True)
    # transformers 5 always writes safetensors (the safe_serialization flag was removed);
    # tied weights (e.g. lm_head = embed_tokens) are stored once and re-tied on load.
    model.save_pretrained(out_dir)
    tokenizer_dir = policy_dir(checkpoint_path) / TOKENIZER_DIR
    if tokenizer_dir.is_dir():
        AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(str(out_dir))
    else:
        logger.warning(
            "Checkpoint %s has no %s; exporting the model without a tokenizer.",
            checkpoint_path,
            tokenizer_dir,
        )
    logger.info("Exported %s to %s", checkpoint_path, out_dir)
    return out_dir
