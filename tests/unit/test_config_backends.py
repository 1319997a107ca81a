"""What each generation backend can do is known in one place (``rlfleet.config.backends``), and the names of
the built-in environments in one place (``rlfleet.config.schema.BUILTIN_ENVIRONMENTS``)."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import rlfleet
from rlfleet.config import load_recipe, resolve_recipe_path
from rlfleet.config.backends import BACKENDS, backend_of
from rlfleet.config.layout import resource_layout
from rlfleet.config.schema import BUILTIN_ENVIRONMENTS, EnvConfig, GenerationConfig
from rlfleet.environments.builtin import BUILTIN

PACKAGE = Path(rlfleet.__file__).parent
# the modules that name the backends: the table, and the one resolution of ``auto``
NAMING_BACKENDS = {PACKAGE / "config" / "backends.py", PACKAGE / "config" / "resolved.py"}
COMPARED_NAME = re.compile(
    r"""[=!]=\s*["'](hf|vllm)["']|["'](hf|vllm)["']\s*[=!]=|\bin\s*\(\s*["'](hf|vllm)["']"""
)


def recipe(*overrides: str):  # type: ignore[no-untyped-def]
    return load_recipe(resolve_recipe_path("grpo-smollm2-135m-arithmetic-cpu"), list(overrides))


def test_every_backend_the_schema_names_has_its_capabilities() -> None:
    choices = set(typing.get_args(GenerationConfig.model_fields["backend"].annotation)) - {"auto"}
    assert choices == set(BACKENDS)
    assert all(name == info.name for name, info in BACKENDS.items())


def test_backend_of_a_config_and_of_its_layout_agree() -> None:
    for name in BACKENDS:
        cfg = recipe(f"policy.generation.backend={name}")
        assert backend_of(cfg) is backend_of(resource_layout(cfg)) is BACKENDS[name]
    assert not BACKENDS["hf"].holds_own_weights and BACKENDS["vllm"].holds_own_weights
    vllm_tp2 = recipe(
        "policy.generation.backend=vllm",
        "cluster.gpus_per_node=2",
        "policy.generation.vllm_cfg.tensor_parallel_size=2",
    )
    assert resource_layout(vllm_tp2).gen_tp == 2  # only a backend with tensor parallelism reads the key
    hf_tp2 = recipe(
        "policy.generation.backend=hf",
        "cluster.gpus_per_node=2",
        "policy.generation.vllm_cfg.tensor_parallel_size=2",
    )
    assert resource_layout(hf_tp2).gen_tp == 1


def test_no_module_compares_a_backend_name() -> None:
    found = [
        f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path not in NAMING_BACKENDS
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if COMPARED_NAME.search(line)
    ]
    assert not found, "read a capability of rlfleet.config.backends instead:\n" + "\n".join(found)


def test_the_built_in_environments_are_named_once() -> None:
    assert tuple(BUILTIN) == BUILTIN_ENVIRONMENTS
    assert set(BUILTIN_ENVIRONMENTS) <= set(EnvConfig.model_fields)  # each has its env.<name> section
