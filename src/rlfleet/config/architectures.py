"""A model's real configuration, offline: the ``config.json`` of each hub model a shipped GPU recipe names
ships in ``model_configs/`` (hyperparameters only, no weights; sources and licences in its README), so that
``rlfleet plan`` and ``rlfleet rehearse`` build and count the real architecture without the hub.

A recipe whose ``policy.model_name`` (or ``teacher.model_name``) is such a model gets its
``policy.architecture`` from that file when it sets none; one it sets must agree with the file, or the recipe
is refused with the keys that differ. For a model that is not shipped (a local directory, another hub id) the
recipe's own ``architecture`` block stays what ``plan`` counts, as before.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlfleet.config.schema import ArchitectureConfig, MasterConfig, PolicyConfig

if TYPE_CHECKING:
    from transformers import PretrainedConfig

MODEL_CONFIGS = Path(__file__).parent / "model_configs"


def shipped_model_config(model_name: str) -> Path | None:
    """The shipped directory holding ``model_name``'s ``config.json``; None for a model not shipped or a
    path that exists here (a local model has its own)."""
    if not model_name or ".." in Path(model_name).parts or Path(model_name).expanduser().exists():
        return None
    directory = MODEL_CONFIGS / model_name
    return directory if (directory / "config.json").is_file() else None


def shipped_model_names() -> list[str]:
    return sorted(p.parent.relative_to(MODEL_CONFIGS).as_posix() for p in MODEL_CONFIGS.rglob("config.json"))


def load_model_config(model_name: str) -> PretrainedConfig:
    """``model_name``'s configuration: the shipped file, else a local directory's or the hub cache's.

    Raises:
        FileNotFoundError: none is available offline.
    """
    from transformers import AutoConfig

    shipped = shipped_model_config(model_name)
    source = str(shipped) if shipped is not None else model_name
    try:
        config: PretrainedConfig = AutoConfig.from_pretrained(source, local_files_only=True)
    except OSError as exc:
        raise FileNotFoundError(
            f"no configuration of {model_name!r} here (shipped ones: {', '.join(shipped_model_names())}); "
            "fix: a local model directory, or a hub id whose files are cached"
        ) from exc
    return config


def architecture_of(config: PretrainedConfig) -> ArchitectureConfig:
    """The decoder's size as ``plan`` counts it (a multimodal model's text decoder: ``text_config``), and
    the parameters the model loads beside it (a vision tower and projector, counted on the meta device)."""
    text = config.get_text_config()
    other = 0 if text is config else _meta_parameters(config) - _meta_parameters(text)
    head_dim = getattr(text, "head_dim", None)
    return ArchitectureConfig(
        hidden_size=text.hidden_size,
        num_hidden_layers=text.num_hidden_layers,
        num_attention_heads=text.num_attention_heads,
        num_key_value_heads=getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
        head_dim=head_dim if head_dim and head_dim != text.hidden_size // text.num_attention_heads else None,
        intermediate_size=text.intermediate_size,
        vocab_size=text.vocab_size,
        tie_word_embeddings=bool(getattr(text, "tie_word_embeddings", False)),
        other_parameters=other,
    )


def _meta_parameters(config: PretrainedConfig) -> int:
    """Every parameter of the causal LM ``config`` builds, built on the meta device (no memory)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return int(sum(p.numel() for p in model.parameters()))


@cache
def shipped_architecture(model_name: str) -> ArchitectureConfig:
    return architecture_of(load_model_config(model_name))


def _resolved(section: PolicyConfig, key: str) -> tuple[ArchitectureConfig | None, list[str]]:
    if shipped_model_config(section.model_name) is None:
        return section.architecture, []
    real = shipped_architecture(section.model_name)
    given = section.architecture
    if given is None:
        return real, []
    differ = _differences(given.model_dump(), real.model_dump())
    if not differ:
        return given, []
    return given, [
        f"{key}.architecture disagrees with the configuration of {section.model_name} shipped with rlfleet "
        f"({'; '.join(differ)}); fix: remove {key}.architecture (it is read from that configuration), or set "
        f"{key}.model_name to the model it describes"
    ]


def _differences(given: dict[str, Any], real: dict[str, Any]) -> list[str]:
    return [
        f"{name}: {given[name]} here, {real[name]} in config.json"
        for name in real
        if given[name] != real[name]
    ]


def with_known_architectures(cfg: MasterConfig) -> tuple[MasterConfig, list[str]]:
    """``cfg`` with ``policy.architecture`` (and the teacher's) read from a shipped configuration where the
    recipe sets none, and the problems of one that disagrees with it."""
    policy, problems = _resolved(cfg.policy, "policy")
    update: dict[str, Any] = {"policy": cfg.policy.model_copy(update={"architecture": policy})}
    if cfg.teacher is not None:
        teacher, more = _resolved(cfg.teacher, "teacher")
        problems += more
        update["teacher"] = cfg.teacher.model_copy(update={"architecture": teacher})
    return cfg.model_copy(update=update), problems
