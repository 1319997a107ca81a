"""Loading, overriding and validating recipes, and finding the shipped ones.

A recipe is a YAML file whose top-level ``defaults:`` names parent recipes (NeMo RL style); command-line
overrides follow Hydra's grammar (see :mod:`rlfleet.config.overrides`); the merged mapping is validated
against :class:`~rlfleet.config.schema.MasterConfig`. What one field alone cannot show is checked in
:mod:`rlfleet.config.checks`. Every user-facing problem raises :class:`ConfigError`, whose message lists all
problems found, one per line, each naming the dotted key, the offending value, the constraint and a fix.
"""

from __future__ import annotations

import difflib
import re
import types
import typing
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError, create_model

import rlfleet
from rlfleet.config.algorithm import Algorithm, algorithm_names, algorithm_specs
from rlfleet.config.architectures import with_known_architectures
from rlfleet.config.checks import section_problems
from rlfleet.config.errors import ConfigError, deep_merge, got, short_repr
from rlfleet.config.overrides import Override, apply_overrides, parse_override
from rlfleet.config.schema import MasterConfig

__all__ = [
    "ConfigError",
    "MasterConfig",
    "Override",
    "apply_overrides",
    "config_to_yaml",
    "deep_merge",
    "load_recipe",
    "load_yaml_with_defaults",
    "master_model",
    "parse_override",
    "recipe_algorithm",
    "resolve_recipe_path",
    "schema_keys",
    "shipped_recipe_dirs",
    "shipped_recipe_names",
    "validate_config",
]

# --------------------------------------------------------------------------------------------- YAML files


class _RecipeLoader(yaml.SafeLoader):
    """SafeLoader as OmegaConf configures it: ``1e-5`` is a float, dates stay strings, duplicate keys fail."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[str] = set()
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                if key_node.value in seen:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping",
                        node.start_mark,
                        f"found duplicate key {key_node.value!r}",
                        key_node.start_mark,
                    )
                seen.add(key_node.value)
        return super().construct_mapping(node, deep=deep)


_DROPPED_RESOLVERS = ("tag:yaml.org,2002:float", "tag:yaml.org,2002:timestamp")
_RecipeLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in _DROPPED_RESOLVERS]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_RecipeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?[0-9][0-9_]*(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def _read_mapping(path: Path, referenced_by: Path | None) -> dict[str, Any]:
    via = f" (referenced by `defaults` in {referenced_by})" if referenced_by else ""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"recipe file not found: {path}{via}; fix the path or create the file") from None
    except OSError as exc:
        raise ConfigError(f"cannot read recipe file {path}{via}: {exc.strerror or exc}") from None
    try:
        data = yaml.load(text, Loader=_RecipeLoader)  # a SafeLoader subclass
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = exc.problem or exc.context or "syntax error"
        raise ConfigError(f"invalid YAML in {path}{where}: {problem}; fix the syntax there") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"invalid YAML in {path}: {exc}; fix the syntax") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"recipe {path}{via}: top level is {type(data).__name__}, expected a mapping of sections "
            "(e.g. `policy:`, `grpo:`); fix the file so its top level is `key: value` pairs"
        )
    return data


def _parent_paths(defaults: Any, child: Path) -> list[Path | None]:
    """Parent recipe paths named by ``defaults`` (``None`` marks Hydra's ``_self_`` position)."""
    entries = [] if defaults is None else [defaults] if isinstance(defaults, str) else defaults
    if not isinstance(entries, list) or not all(isinstance(e, str) and e for e in entries):
        raise ConfigError(
            f"{child}: defaults: got {short_repr(defaults)}, expected a parent recipe path or a list of "
            "paths (relative to this file); fix e.g. `defaults: ../base.yaml`"
        )
    paths: list[Path | None] = []
    for entry in entries:
        if entry == "_self_":
            paths.append(None)
            continue
        path = Path(entry).expanduser()
        path = path if path.is_absolute() else child.parent / path
        with_suffix = path.with_name(path.name + ".yaml")
        if not path.exists() and path.suffix not in (".yaml", ".yml") and with_suffix.exists():
            path = with_suffix  # Hydra names parents without the extension
        paths.append(path)
    return paths


def _load_recursive(path: Path, chain: tuple[Path, ...], referenced_by: Path | None) -> dict[str, Any]:
    resolved = path.resolve()
    if resolved in chain:
        cycle = [*chain[chain.index(resolved) :], resolved]
        raise ConfigError(
            "recipe `defaults` form a cycle: "
            + " -> ".join(str(p) for p in cycle)
            + "; fix: remove one of these `defaults` entries"
        )
    data = _read_mapping(path, referenced_by)
    parents = _parent_paths(data.pop("defaults", None), path)
    if None not in parents:
        parents.append(None)  # Hydra: `_self_` is implicitly last, so the child wins
    merged: dict[str, Any] = {}
    for parent in parents:
        layer = data if parent is None else _load_recursive(parent, (*chain, resolved), path)
        merged = deep_merge(merged, layer)
    return merged


def load_yaml_with_defaults(path: str | Path) -> dict[str, Any]:
    """Read a recipe and, recursively, the parents its ``defaults:`` names, merged with the child winning.

    ``defaults`` is a path or a list of paths, relative to the file that names them; parents are merged in
    order, then the child on top (or at the position of a ``_self_`` entry, as in Hydra).

    Raises:
        ConfigError: a file is missing or unreadable, is not YAML, is not a mapping, or defaults cycle.
    """
    return _load_recursive(Path(path).expanduser(), (), None)


# --------------------------------------------------------------------------------------------- schema


def _submodel(annotation: Any) -> type[BaseModel] | None:
    """The BaseModel a field holds (directly or as ``Model | None``), else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        models = [a for a in typing.get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
        return models[0] if len(models) == 1 else None
    return None


def _paths(model: type[BaseModel], prefix: str, sections: bool) -> list[str]:
    paths: list[str] = []
    for name, field in model.model_fields.items():
        sub = _submodel(field.annotation)
        if sub is None:
            paths.append(prefix + name)
            continue
        if sections:
            paths.append(prefix + name)
        paths.extend(_paths(sub, f"{prefix}{name}.", sections))
    return paths


def schema_keys() -> list[str]:
    """Every dotted leaf key of :class:`MasterConfig` (``policy.optimizer.kwargs.lr``, ...), in order."""
    return _paths(master_model(), "", sections=False)


@cache
def _all_paths() -> tuple[str, ...]:
    return tuple(_paths(master_model(), "", sections=True))


@cache
def _defaults() -> dict[str, Any]:
    return master_model()().model_dump(mode="json")


def _model_at(loc: Sequence[Any]) -> type[BaseModel] | None:
    model: type[BaseModel] | None = master_model()
    for part in loc:
        field = model.model_fields.get(part) if model and isinstance(part, str) else None
        model = _submodel(field.annotation) if field else None
    return model


def _dotted(loc: Sequence[Any]) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else f".{part}" if text else str(part)
    return text or "<top level>"


def config_to_yaml(cfg: MasterConfig) -> str:
    """The whole config as YAML (every key, defaults included), loadable as a recipe."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False, allow_unicode=True)


# --------------------------------------------------------------------------------------------- validation

_EXPECTED = {
    "int_parsing": "an integer",
    "int_type": "an integer",
    "int_from_float": "an integer (a whole number)",
    "float_parsing": "a number",
    "float_type": "a number",
    "finite_number": "a finite number",
    "bool_parsing": "a boolean (true or false)",
    "bool_type": "a boolean (true or false)",
    "string_type": "a string (quote it in YAML if it looks like a number or boolean)",
    "model_type": "a mapping of this section's keys",
    "model_attributes_type": "a mapping of this section's keys",
    "dict_type": "a mapping",
    "list_type": "a list",
    "tuple_type": "a list",
}
_BOUNDS = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}


def _expected(error: Any) -> str:
    kind, ctx = error["type"], error.get("ctx") or {}
    if kind in _EXPECTED:
        return _EXPECTED[kind]
    if kind == "literal_error":
        return f"one of {ctx.get('expected')}"
    if kind in _BOUNDS:
        bound = next(iter(ctx.values()), "?")
        return f"a value {_BOUNDS[kind]} {bound}"
    msg: str = error["msg"]
    return msg[:1].lower() + msg[1:]


def _fix(loc: Sequence[Any]) -> str:
    node: Any = _defaults()
    field_loc: list[str] = []
    for part in loc:
        if not (isinstance(part, str) and isinstance(node, dict) and part in node):
            break
        node, field_loc = node[part], [*field_loc, part]
    key = _dotted(field_loc)
    if isinstance(node, dict):
        return f"give {key} a mapping of its keys, or remove it to use the section's defaults"
    # which layer set the bad value (a recipe, its parent, an override) is not known here: removing it may
    # bring back a recipe's value, not the schema's, so the default is named as the schema's
    return f"set {key} to a valid value (the schema's default is {short_repr(node)})"


def _unknown_key(loc: Sequence[Any], value: Any) -> str:
    dotted, name, parent = _dotted(loc), str(loc[-1]), loc[:-1]
    model = _model_at(parent)
    level = list(model.model_fields) if model else []
    prefix = f"{_dotted(parent)}." if parent else ""
    candidates = [prefix + m for m in difflib.get_close_matches(name, level, n=3, cutoff=0.6)]
    candidates += [p for p in _all_paths() if p.rsplit(".", 1)[-1] == name]  # same key in another section
    candidates += [
        p
        for p in difflib.get_close_matches(dotted, _all_paths(), n=3, cutoff=0.85)
        if not dotted.startswith(p + ".")  # an ancestor section is no suggestion
    ]
    candidates = list(dict.fromkeys(candidates))[:3]
    where = f"section {_dotted(parent)}" if parent else "the top level"
    if candidates:
        hint = "did you mean " + " or ".join(candidates) + "?"
    else:
        hint = f"valid keys there: {', '.join(level)}."
    return (
        f"{dotted}: unknown key (value {short_repr(value)}); {where} has no such field, {hint} "
        "Fix the spelling or remove the key"
    )


def _describe(error: Any) -> str:
    loc, kind = error["loc"], error["type"]
    if kind == "extra_forbidden":
        return _unknown_key(loc, error.get("input"))
    if kind in ("value_error", "assertion_error"):
        return f"{_dotted(loc)}: {error['msg'].removeprefix('Value error, ')}"
    return f"{_dotted(loc)}: {got(error.get('input'))}, expected {_expected(error)}; fix: {_fix(loc)}"


def validate_config(raw: dict[str, Any]) -> MasterConfig:
    """Build the :class:`MasterConfig` of a merged recipe mapping.

    Raises:
        ConfigError: listing every schema violation at once (an unknown key names the closest valid keys),
            else every contradiction within a section (:func:`rlfleet.config.checks.section_problems`).
    """
    if not isinstance(raw, dict):
        raise ConfigError(
            f"config: {got(raw)}, expected a mapping of sections (policy, grpo, ...); "
            "fix the recipe's top level"
        )
    try:
        cfg = master_model().model_validate(raw)
    except ValidationError as exc:
        problems = [_describe(error) for error in exc.errors(include_url=False)]
        raise ConfigError(problems, header=f"invalid config ({len(problems)} problem(s)):") from exc
    cfg, problems = with_known_architectures(cfg)  # a shipped model's real size, or a block checked
    problems = section_problems(cfg) + problems
    if problems:
        raise ConfigError(problems, header=f"invalid config ({len(problems)} problem(s)):")
    return cfg


def load_recipe(path: str | Path, overrides: Sequence[str] = ()) -> MasterConfig:
    """Load a recipe file with its ``defaults``, apply command-line ``overrides`` and validate it.

    Raises:
        ConfigError: listing the problems of the file, the overrides or the resulting config.
    """
    raw = apply_overrides(load_yaml_with_defaults(path), overrides)
    try:
        return validate_config(raw)
    except ConfigError as exc:
        source = f"recipe {path}" + (" with its command-line overrides" if overrides else "")
        header = f"{source} is invalid ({len(exc.problems)} problem(s)):"
        raise ConfigError(exc.problems, header=header) from exc


# ---------------------------------------------------------------------------------------- shipped recipes


def shipped_recipe_dirs() -> list[Path]:
    """Existing shipped-recipe directories: ``<repo>/recipes`` (editable install), ``rlfleet/_recipes``."""
    package_file = Path(rlfleet.__file__)
    candidates = [package_file.parents[2] / "recipes", package_file.parent / "_recipes"]
    return [d for d in dict.fromkeys(c.resolve() for c in candidates) if d.is_dir()]


def shipped_recipe_names() -> list[str]:
    """Names of the shipped recipes (paths below a recipe directory, without ``.yaml``)."""
    names = {
        f.relative_to(d).with_suffix("").as_posix() for d in shipped_recipe_dirs() for f in d.rglob("*.yaml")
    }
    return sorted(names)


def recipe_algorithm(recipe: str | Path) -> Algorithm:
    """The algorithm a recipe is for, from its content, never its file name: its ``algorithm:`` key, else the
    one algorithm section it sets itself (``grpo:``, ``dpo:``, ...), else the algorithm of the parents its
    ``defaults`` name (the same rule, nearest first). A recipe derived from a GRPO recipe that adds a
    ``dpo:`` section is a DPO recipe.

    Raises:
        ConfigError: the recipe names an unknown algorithm, sets several algorithms' sections, or sets none
            (anywhere in its ``defaults``); the message says to add ``algorithm: NAME`` (or, where a command
            asks, to pass ``--algorithm``).
    """
    path = resolve_recipe_path(recipe)
    found = _deciding_algorithm(path, ())
    if found is None:
        raise ConfigError(
            f"recipe {path} names no algorithm: it sets none of the sections "
            f"{', '.join(algorithm_names())} (nor do its defaults); fix: add `algorithm: NAME` to it, or "
            "pass --algorithm NAME"
        )
    return found


def _deciding_algorithm(path: Path, chain: tuple[Path, ...]) -> str | None:
    resolved = path.resolve()
    if resolved in chain:
        return None  # the loader reports the cycle
    data = _read_mapping(path, chain[-1] if chain else None)
    explicit = data.get("algorithm")
    if explicit is not None:
        if not isinstance(explicit, str) or explicit not in algorithm_names():
            raise ConfigError(
                f"{path}: algorithm: got {short_repr(explicit)}, expected one of "
                f"{', '.join(algorithm_names())}; fix: algorithm: grpo (for example)"
            )
        return explicit
    sections = [name for name in algorithm_names() if name in data]
    if len(sections) > 1:
        raise ConfigError(
            f"{path} sets the sections of {len(sections)} algorithms ({', '.join(sections)}), so which one "
            f"it is for is ambiguous; fix: add `algorithm: {sections[0]}` (or the one meant) to it"
        )
    if sections:
        return sections[0]
    parents = {
        p: _deciding_algorithm(p, (*chain, resolved)) for p in _parent_paths(data.get("defaults"), path) if p
    }
    named = sorted({a for a in parents.values() if a is not None})
    if len(named) > 1:
        raise ConfigError(
            f"{path}: its defaults are recipes of different algorithms ({', '.join(named)}); fix: add "
            f"`algorithm: {named[0]}` (or the one meant) to it"
        )
    return named[0] if named else None


@cache
def master_model() -> type[MasterConfig]:
    """The schema of a recipe: :class:`MasterConfig` with the section of every algorithm a plugin adds
    (:mod:`rlfleet.config.algorithm`); MasterConfig itself when no plugin is installed."""
    extra = {
        spec.name: (spec.section, spec.section())
        for spec in algorithm_specs()
        if spec.name not in MasterConfig.model_fields
    }
    if not extra:
        return MasterConfig
    model: type[MasterConfig] = create_model("MasterConfig", __base__=MasterConfig, **extra)  # type: ignore[call-overload]
    return model


def resolve_recipe_path(name_or_path: str | Path) -> Path:
    """An existing recipe file, else the shipped recipe of that name (``.yaml`` optional).

    Raises:
        ConfigError: neither exists; the message lists the shipped recipe names.
    """
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path.resolve()
    if path.is_dir():
        raise ConfigError(f"recipe {str(name_or_path)!r} is a directory; fix: pass a YAML file in it")
    name = str(name_or_path)
    for directory in shipped_recipe_dirs():
        for candidate in (directory / name, directory / f"{name}.yaml"):
            if candidate.is_file():
                return candidate.resolve()
    names = shipped_recipe_names()
    close = difflib.get_close_matches(name.removesuffix(".yaml"), names, n=3)
    hint = f" Did you mean {' or '.join(close)}?" if close else ""
    raise ConfigError(
        f"recipe {name!r} is neither an existing file nor a shipped recipe (shipped: "
        f"{', '.join(names) or 'none found'}).{hint} Fix: pass the path of a YAML recipe or a shipped name"
    )
