"""Export an rlfleet (DCP) checkpoint to a Hugging Face ``save_pretrained`` directory, or its LoRA adapter
alone in PEFT's format."""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors.torch import save_file
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedModel,
)

from rlfleet.checkpoint.dcp_io import TOKENIZER_DIR, load_model_state_dict, policy_dir
from rlfleet.checkpoint.manager import CONFIG_FILE, is_complete_checkpoint, verify_checkpoint
from rlfleet.config.schema import LoraConfig
from rlfleet.models.gguf import drop_gguf_config
from rlfleet.models.loading import DTYPES, resolve_model_path, reward_model_config
from rlfleet.models.lora import adapter_state, merge_adapters

PEFT_PREFIX = "base_model.model."  # PEFT's key prefix for a causal LM's modules
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"

logger = logging.getLogger(__name__)


def build_model_from_name(
    model_name: str,
    *,
    gguf_file: str | None = None,
    trust_remote_code: bool = False,
    reward_model: bool = False,
    pad_token_id: int | None = None,
) -> PreTrainedModel:
    """Build a randomly initialised causal LM (or reward model) with the architecture of ``model_name``.

    Only the config is read; no weights are downloaded or loaded.

    Args:
        model_name: Hugging Face hub id or local directory holding a ``config.json``.
        gguf_file: A GGUF file inside ``model_name`` whose architecture to use (the config keeps
            no GGUF record: the exported model is a plain one).
        trust_remote_code: Allow custom modelling code from the model repository.
        reward_model: The sequence classifier with one label that ``rlfleet rm`` trains from
            ``model_name`` (``rlfleet.models.loading.reward_model_config``), ``pad_token_id`` in its config.
        pad_token_id: The tokenizer's padding id (a reward model's head reads the last token before it).
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
    if reward_model:
        classifier = reward_model_config(config, pad_token_id)
        scorer: PreTrainedModel = AutoModelForSequenceClassification.from_config(
            classifier, trust_remote_code=trust_remote_code
        )
        return scorer
    model: PreTrainedModel = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    return model


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
        # transformers' @wraps on PreTrainedModel.to hides the bound self from mypy
        model.to(dtype)  # type: ignore[arg-type]
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


def _recipe_value(checkpoint_path: Path, keys: tuple[str, ...]) -> Any:
    """The value at ``keys`` in the recipe saved with the checkpoint, or None where a key is unset."""
    with (checkpoint_path / CONFIG_FILE).open(encoding="utf-8") as handle:
        raw: Any = yaml.safe_load(handle) or {}
    for key in keys:
        raw = raw.get(key) if isinstance(raw, dict) else None
    return raw


def _is_reward_model(checkpoint_path: Path) -> bool:
    """Whether the recipe saved with the checkpoint trained a reward model (``policy.reward_model_cfg``)."""
    return _recipe_value(checkpoint_path, ("policy", "reward_model_cfg", "enabled")) is True


def _lora_from_config(checkpoint_path: Path) -> LoraConfig:
    """``policy.dtensor_cfg.lora_cfg`` of the recipe saved with the checkpoint (defaults where unset)."""
    return LoraConfig.model_validate(
        _recipe_value(checkpoint_path, ("policy", "dtensor_cfg", "lora_cfg")) or {}
    )


def peft_adapter_config(lora: LoraConfig, target_modules: list[str], base_model: str) -> dict[str, Any]:
    """PEFT's ``adapter_config.json`` for adapters on ``target_modules`` (full module names)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora.dim,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": target_modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
    }


def write_peft_adapter(
    adapters: dict[str, torch.Tensor], lora: LoraConfig, base_model: str, out_dir: Path
) -> Path:
    """Writes ``adapter_config.json`` and ``adapter_model.safetensors`` (keys
    ``base_model.model.<module>.lora_A.weight``): ``PeftModel.from_pretrained(base, out_dir)`` loads them.

    PEFT puts its dropout on the adapter's input (``dropout_position: pre``); inference runs no dropout,
    so the loaded model is the trained one whatever the position.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    targets = sorted({name.rsplit(".", 2)[0] for name in adapters})
    tensors = {PEFT_PREFIX + name: value.detach().contiguous() for name, value in adapters.items()}
    save_file(tensors, str(out_dir / ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})
    config = peft_adapter_config(lora, targets, base_model)
    (out_dir / ADAPTER_CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out_dir


def export_hf(checkpoint_path: Path, out_dir: Path, *, adapter_only: bool = False) -> Path:
    """Convert a checkpoint step directory to a Hugging Face model directory (or a PEFT adapter).

    The architecture comes from ``policy.model_name`` in the checkpoint's ``config.yaml``; the
    weights from ``policy/weights`` (DCP); the tokenizer from ``policy/tokenizer`` when present.
    The result loads with ``AutoModelForCausalLM.from_pretrained(out_dir)`` (safetensors); a reward
    model's (``policy.reward_model_cfg.enabled``) with
    ``AutoModelForSequenceClassification.from_pretrained(out_dir)``, which the ``reward_model`` environment
    reads (``env.reward_model.model_name=out_dir``). Checkpoints
    hold float32 master weights; the export is written in the run's ``policy.precision`` (its compute
    dtype: a bfloat16 run exports bfloat16, half the size). A LoRA run's adapters are merged into the base
    weights (``W + alpha/dim * B A``, in float32); with ``adapter_only`` the adapters alone are written in
    PEFT's format instead (float32, ``adapter_config.json`` + ``adapter_model.safetensors``).

    Args:
        checkpoint_path: A complete ``step_N`` directory.
        out_dir: Destination directory (created if needed; existing files are overwritten).
        adapter_only: Write the LoRA adapter alone (a LoRA run's checkpoint only).

    Returns:
        ``out_dir``.

    Raises:
        FileNotFoundError: ``checkpoint_path`` is not a complete checkpoint.
        CheckpointError: Its files do not match its ``manifest.json`` (truncated, missing or altered).
        ValueError: The recipe lacks ``policy.model_name``, the weights do not fit its architecture, or
            ``adapter_only`` on a checkpoint without adapters.
    """
    checkpoint_path = Path(checkpoint_path)
    out_dir = Path(out_dir)
    _require_complete(checkpoint_path)
    verify_checkpoint(checkpoint_path)
    model_name, gguf_file, precision = _model_name_from_config(checkpoint_path)
    state_dict = load_model_state_dict(checkpoint_path)
    adapters = adapter_state(state_dict)
    lora = _lora_from_config(checkpoint_path) if adapters else None
    if adapter_only:
        if lora is None:
            raise ValueError(
                f"{checkpoint_path} holds no LoRA adapters (policy.dtensor_cfg.lora_cfg.enabled was false); "
                "export the whole model instead (drop --adapter-only)"
            )
        write_peft_adapter(adapters, lora, model_name, out_dir)
        logger.info("Exported the LoRA adapter of %s to %s", checkpoint_path, out_dir)
        return out_dir
    if lora is not None:
        state_dict = merge_adapters(state_dict, lora.alpha / lora.dim)
    tokenizer_dir = policy_dir(checkpoint_path) / TOKENIZER_DIR
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir)) if tokenizer_dir.is_dir() else None
    model = build_model_from_name(
        model_name,
        gguf_file=gguf_file,
        reward_model=_is_reward_model(checkpoint_path),
        pad_token_id=tokenizer.pad_token_id if tokenizer is not None else None,
    )
    _load_weights(model, state_dict, model_name)
    if precision is not None:
        # transformers' @wraps on PreTrainedModel.to hides the bound self from mypy
        model.to(DTYPES[precision])  # type: ignore[arg-type]
    out_dir.mkdir(parents=True, exist_ok=True)
    # transformers 5 always writes safetensors (the safe_serialization flag was removed);
    # tied weights (e.g. lm_head = embed_tokens) are stored once and re-tied on load.
    model.save_pretrained(out_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out_dir))
    else:
        logger.warning(
            "Checkpoint %s has no %s; exporting the model without a tokenizer.",
            checkpoint_path,
            tokenizer_dir,
        )
    logger.info("Exported %s to %s", checkpoint_path, out_dir)
    return out_dir
