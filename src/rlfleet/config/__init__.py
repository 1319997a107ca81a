"""Recipe configuration: the schema, the YAML loader with ``defaults``, Hydra-style overrides, checks.

The names below are loaded on first use (PEP 562): importing one submodule (``rlfleet.config.strict``, as an
algorithm's own config section does) loads that submodule alone, not the whole package, so the schema can
import the algorithms' sections without an import cycle.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlfleet.config.checks import check_config, ensure_runnable, unsupported_settings
    from rlfleet.config.embedded import DEMO_COMMANDS, DEMO_TASKS, PRETRAINED_DEMO_TASKS
    from rlfleet.config.errors import ConfigError
    from rlfleet.config.loader import (
        config_to_yaml,
        load_recipe,
        load_yaml_with_defaults,
        recipe_algorithm,
        resolve_recipe_path,
        schema_keys,
        shipped_recipe_dirs,
        shipped_recipe_names,
        validate_config,
    )
    from rlfleet.config.metric_names import normalize_metric_name
    from rlfleet.config.overrides import Override, apply_overrides, parse_override, quote_override_value
    from rlfleet.config.schema import MasterConfig

_EXPORTS = {
    "check_config": "checks",
    "ensure_runnable": "checks",
    "unsupported_settings": "checks",
    "DEMO_COMMANDS": "embedded",
    "DEMO_TASKS": "embedded",
    "PRETRAINED_DEMO_TASKS": "embedded",
    "ConfigError": "errors",
    "config_to_yaml": "loader",
    "load_recipe": "loader",
    "load_yaml_with_defaults": "loader",
    "recipe_algorithm": "loader",
    "resolve_recipe_path": "loader",
    "schema_keys": "loader",
    "shipped_recipe_dirs": "loader",
    "shipped_recipe_names": "loader",
    "validate_config": "loader",
    "normalize_metric_name": "metric_names",
    "Override": "overrides",
    "apply_overrides": "overrides",
    "parse_override": "overrides",
    "quote_override_value": "overrides",
    "MasterConfig": "schema",
}

__all__ = [
    "DEMO_COMMANDS",
    "DEMO_TASKS",
    "PRETRAINED_DEMO_TASKS",
    "ConfigError",
    "MasterConfig",
    "Override",
    "apply_overrides",
    "check_config",
    "config_to_yaml",
    "ensure_runnable",
    "load_recipe",
    "load_yaml_with_defaults",
    "normalize_metric_name",
    "parse_override",
    "quote_override_value",
    "recipe_algorithm",
    "resolve_recipe_path",
    "schema_keys",
    "shipped_recipe_dirs",
    "shipped_recipe_names",
    "unsupported_settings",
    "validate_config",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rlfleet.config' has no attribute {name!r}")
    return getattr(importlib.import_module(f"rlfleet.config.{module}"), name)
