"""Recipe configuration: the schema, the YAML loader with ``defaults``, Hydra-style overrides, checks."""

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
from rlfleet.config.metric_names import LOGGED_METRICS, normalize_metric_name
from rlfleet.config.overrides import Override, apply_overrides, parse_override, quote_override_value
from rlfleet.config.schema import MasterConfig

__all__ = [
    "DEMO_COMMANDS",
    "DEMO_TASKS",
    "LOGGED_METRICS",
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
