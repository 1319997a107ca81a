"""Recipe loading (``defaults`` inheritance), Hydra-style overrides, schema validation, cross-field checks."""

from __future__ import annotations

import math
import pickle
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

import rlfleet
from rlfleet.config import (
    ConfigError,
    MasterConfig,
    apply_overrides,
    check_config,
    config_to_yaml,
    load_recipe,
    load_yaml_with_defaults,
    normalize_metric_name,
    parse_override,
    quote_override_value,
    resolve_recipe_path,
    schema_keys,
    validate_config,
)
from rlfleet.config import loader as loader_module
from rlfleet.config.algorithm import algorithm_spec


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def good_raw() -> dict[str, Any]:
    """A config that passes every cross-field check for both algorithms."""
    return {
        "policy": {
            "model_name": "tiny-model",
            "train_global_batch_size": 32,
            "train_micro_batch_size": 8,
            "max_total_sequence_length": 256,
            "generation": {"max_new_tokens": 64},
        },
        "grpo": {"num_prompts_per_step": 8, "num_generations_per_prompt": 4},
        "checkpointing": {"metric_name": "val:accuracy", "keep_top_k": 2},
    }


# ----------------------------------------------------------------------------------------- YAML + defaults


def test_child_wins_and_nested_sections_merge(tmp_path: Path) -> None:
    write(
        tmp_path / "base.yaml",
        "policy:\n  model_name: base\n  optimizer:\n    kwargs: {lr: 1.0e-3, eps: 1.0e-6}\n",
    )
    child = write(
        tmp_path / "child.yaml",
        "defaults: base.yaml\npolicy:\n  optimizer:\n    kwargs:\n      lr: 2.0e-4\n",
    )
    raw = load_yaml_with_defaults(child)
    assert raw == {"policy": {"model_name": "base", "optimizer": {"kwargs": {"lr": 2.0e-4, "eps": 1.0e-6}}}}
    assert "defaults" not in raw


def test_lists_and_scalars_replace_not_merge(tmp_path: Path) -> None:
    write(tmp_path / "base.yaml", "data:\n  arithmetic:\n    operations: ['+', '-', '*']\n    seed: 1\n")
    child = write(
        tmp_path / "child.yaml", "defaults: base.yaml\ndata:\n  arithmetic:\n    operations: ['*']\n"
    )
    assert load_yaml_with_defaults(child)["data"]["arithmetic"] == {"operations": ["*"], "seed": 1}


def test_parent_path_is_relative_to_the_child_directory(tmp_path: Path) -> None:
    write(tmp_path / "shared" / "base.yaml", "grpo:\n  seed: 7\n  max_num_steps: 3\n")
    child = write(
        tmp_path / "exp" / "deep" / "child.yaml", "defaults: ../../shared/base.yaml\ngrpo:\n  seed: 9\n"
    )
    assert load_yaml_with_defaults(child) == {"grpo": {"seed": 9, "max_num_steps": 3}}


def test_grandparent_chain_resolves_each_path_against_its_own_file(tmp_path: Path) -> None:
    write(tmp_path / "a" / "root.yaml", "grpo: {seed: 1, max_num_steps: 1}\n")
    write(tmp_path / "b" / "mid.yaml", "defaults: ../a/root.yaml\ngrpo: {max_num_steps: 2}\n")
    child = write(tmp_path / "c" / "leaf.yaml", "defaults: ../b/mid.yaml\n")
    assert load_yaml_with_defaults(child) == {"grpo": {"seed": 1, "max_num_steps": 2}}


def test_list_of_parents_merges_in_order_then_child(tmp_path: Path) -> None:
    write(tmp_path / "one.yaml", "grpo: {seed: 1, max_num_steps: 1, val_period: 1}\n")
    write(tmp_path / "two.yaml", "grpo: {seed: 2, max_num_steps: 2}\n")
    child = write(tmp_path / "child.yaml", "defaults: [one.yaml, two.yaml]\ngrpo: {seed: 3}\n")
    assert load_yaml_with_defaults(child) == {"grpo": {"seed": 3, "max_num_steps": 2, "val_period": 1}}


def test_self_entry_places_the_child_before_later_parents(tmp_path: Path) -> None:
    write(tmp_path / "late.yaml", "grpo: {seed: 2}\n")
    child = write(
        tmp_path / "child.yaml", "defaults: [_self_, late.yaml]\ngrpo: {seed: 1, max_num_steps: 5}\n"
    )
    assert load_yaml_with_defaults(child) == {"grpo": {"seed": 2, "max_num_steps": 5}}


def test_parent_may_omit_the_yaml_extension(tmp_path: Path) -> None:
    write(tmp_path / "base.yaml", "grpo: {seed: 4}\n")
    child = write(tmp_path / "child.yaml", "defaults: base\n")
    assert load_yaml_with_defaults(child) == {"grpo": {"seed": 4}}


@pytest.mark.parametrize(
    ("b_defaults", "pattern"),
    [("a.yaml", r"a\.yaml -> .*b\.yaml -> .*a\.yaml"), ("b", r"b\.yaml -> .*b\.yaml")],
)
def test_defaults_cycle_is_an_error_naming_the_cycle(tmp_path: Path, b_defaults: str, pattern: str) -> None:
    write(tmp_path / "a.yaml", "defaults: b.yaml\n")
    write(tmp_path / "b.yaml", f"defaults: {b_defaults}\n")
    with pytest.raises(ConfigError, match=f"form a cycle: .*{pattern}"):
        load_yaml_with_defaults(tmp_path / "a.yaml")


def test_missing_recipe_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"recipe file not found: .*nope\.yaml"):
        load_yaml_with_defaults(tmp_path / "nope.yaml")


def test_missing_parent_names_the_child(tmp_path: Path) -> None:
    child = write(tmp_path / "child.yaml", "defaults: gone.yaml\n")
    with pytest.raises(
        ConfigError, match=r"recipe file not found: .*gone\.yaml.*referenced by .*child\.yaml"
    ):
        load_yaml_with_defaults(child)


def test_bad_yaml_reports_file_and_line(tmp_path: Path) -> None:
    bad = write(tmp_path / "bad.yaml", "grpo:\n  seed: 1\n  max_num_steps: [1, 2\npolicy: {}\n")
    with pytest.raises(ConfigError, match=r"invalid YAML in .*bad\.yaml at line 4, column \d+"):
        load_yaml_with_defaults(bad)


def test_duplicate_yaml_key_is_an_error_with_its_line(tmp_path: Path) -> None:
    dup = write(tmp_path / "dup.yaml", "grpo:\n  seed: 1\n  seed: 2\n")
    with pytest.raises(ConfigError, match=r"line 3.*duplicate key 'seed'"):
        load_yaml_with_defaults(dup)


@pytest.mark.parametrize("text", ["- a\n- b\n", "just a string\n", "42\n"])
def test_top_level_must_be_a_mapping(tmp_path: Path, text: str) -> None:
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_yaml_with_defaults(write(tmp_path / "r.yaml", text))


def test_empty_recipe_is_an_empty_mapping(tmp_path: Path) -> None:
    assert load_yaml_with_defaults(write(tmp_path / "r.yaml", "# only a comment\n")) == {}


@pytest.mark.parametrize("defaults", ["3", "[a.yaml, 4]", "{x: a.yaml}"])
def test_defaults_must_be_paths(tmp_path: Path, defaults: str) -> None:
    with pytest.raises(ConfigError, match="defaults: got"):
        load_yaml_with_defaults(write(tmp_path / "r.yaml", f"defaults: {defaults}\n"))


def test_yaml_exponent_without_dot_is_a_float_and_dates_stay_strings(tmp_path: Path) -> None:
    raw = load_yaml_with_defaults(write(tmp_path / "r.yaml", "a: 1e-5\nb: 5E3\nc: 2024-01-02\nd: 10\n"))
    assert raw == {"a": 1e-5, "b": 5000.0, "c": "2024-01-02", "d": 10}
    assert isinstance(raw["a"], float) and isinstance(raw["d"], int)


# --------------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("section", "typo", "suggestion"),
    [
        ("policy", "modle_name", "policy.model_name"),
        ("policy", "train_micro_batch", "policy.train_micro_batch_size"),
        ("policy", "lr", "policy.optimizer.kwargs.lr"),
    ],
)
def test_unknown_nested_key_names_full_key_and_suggestion(section: str, typo: str, suggestion: str) -> None:
    with pytest.raises(ConfigError) as info:
        validate_config({section: {typo: 1}})
    message = str(info.value)
    assert f"{section}.{typo}: unknown key" in message
    assert suggestion in message.split("did you mean", 1)[1]


@pytest.mark.parametrize(
    ("raw", "line"),
    [
        (
            {"polcy": {}},
            "polcy: unknown key (value {}); the top level has no such field, did you mean policy?",
        ),
        (
            {"policy": {"generation": {"colocated": {"enabeld": False}}}},
            "policy.generation.colocated.enabeld: unknown key (value False); section policy.generation."
            "colocated has no such field, did you mean policy.generation.colocated.enabled?",
        ),
        (
            {"zzzz": 1},
            "zzzz: unknown key (value 1); the top level has no such field, valid keys there: grpo, sft",
        ),
        (
            {"policy": {"train_micro_batch_size": "abc"}},
            "policy.train_micro_batch_size: got 'abc' (str), expected an integer; fix: set "
            "policy.train_micro_batch_size to a valid value (the schema's default is 8)",
        ),
        (
            {"checkpointing": {"keep_top_k": 0}},
            "checkpointing.keep_top_k: got 0 (int), expected a value >= 1",
        ),
        (
            {"policy": {"precision": "fp8"}},
            "policy.precision: got 'fp8' (str), expected one of 'auto', 'float32', 'bfloat16' or 'float16'",
        ),
        ({"grpo": 5}, "grpo: got 5 (int), expected a mapping"),
        (
            {"data": {"arithmetic": {"min_ops": 3, "max_ops": 2}}},
            "data.arithmetic.min_ops=3 exceeds max_ops=2",
        ),
    ],
)
def test_validation_messages(raw: dict[str, Any], line: str) -> None:
    with pytest.raises(ConfigError) as info:
        validate_config(raw)
    assert len(info.value.problems) == 1
    assert line in info.value.problems[0]


def test_all_errors_reported_at_once() -> None:
    raw = {
        "policy": {"modle_name": "x", "train_micro_batch_size": "abc", "optimizer": {"kwargs": {"lr": -1}}},
        "grpo": {"seed": "s"},
        "data": {"arithmetic": {"operations": ["/"]}},
    }
    with pytest.raises(ConfigError) as info:
        validate_config(raw)
    assert len(info.value.problems) == 5
    message = str(info.value)
    for key in (
        "policy.modle_name",
        "policy.train_micro_batch_size",
        "policy.optimizer.kwargs.lr",
        "grpo.seed",
        "data.arithmetic.operations[0]",
    ):
        assert key in message
    assert message.count("\n") == 5  # a header line, then one line per problem


def test_contradiction_within_a_section_is_a_validation_error() -> None:
    with pytest.raises(ConfigError, match=r"data\.arithmetic\.min_ops=3 exceeds max_ops=2"):
        validate_config({"data": {"arithmetic": {"min_ops": 3, "max_ops": 2}}})
    with pytest.raises(ConfigError) as info:
        validate_config(
            {"eval": {"pass_k_value": 3}, "data": {"system_prompt": "a", "system_prompt_file": "f"}}
        )
    assert [p.split(":")[0] for p in info.value.problems] == ["data", "eval"]  # schema order, all at once


def test_section_given_a_scalar() -> None:
    with pytest.raises(ConfigError, match="grpo: got 5 \\(int\\), expected a mapping"):
        validate_config({"grpo": 5})


def test_config_error_survives_pickling() -> None:
    error = ConfigError(["first problem", "second problem"])
    clone = pickle.loads(pickle.dumps(error))
    assert isinstance(clone, ConfigError) and str(clone) == str(error)


# --------------------------------------------------------------------------------------------- overrides


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("a=1", 1),
        ("a=-3", -3),
        ("a=1_000", 1000),
        ("a=0.5", 0.5),
        ("a=1e-5", 1e-5),
        ("a=5E3", 5000.0),
        ("a=.5", 0.5),
        ("a=true", True),
        ("a=True", True),
        ("a=FALSE", False),
        ("a=null", None),
        ("a=NULL", None),
        ("a=None", "None"),
        ("a=[1,2]", [1, 2]),
        ("a=[1, x, [true]]", [1, "x", [True]]),
        ("a={b: 1, c: [x]}", {"b": 1, "c": ["x"]}),
        ("a=[]", []),
        ('a="main"', "main"),
        ("a='main'", "main"),
        ("a='1'", "1"),
        ("a='a,b'", "a,b"),
        ("a=", ""),
        ("a=''", ""),
        ("a=Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct"),
        ("a=val:accuracy", "val:accuracy"),
        ("a=hello world ", "hello world"),
        ("a=x\\,y", "x,y"),
        ("a=00", "00"),
        ("a=-inf", -math.inf),
    ],
)
def test_override_value_typing(text: str, expected: Any) -> None:
    override = parse_override(text)
    assert override.op == "set" and override.key == ("a",)
    assert override.value == expected and type(override.value) is type(expected)


@pytest.mark.parametrize(
    ("text", "op", "key", "value"),
    [
        ("policy.model_name=m", "set", ("policy", "model_name"), "m"),
        ("+policy.model_name=m", "add", ("policy", "model_name"), "m"),
        ("++policy.model_name=m", "force", ("policy", "model_name"), "m"),
        ("~checkpointing.metric_name", "delete", ("checkpointing", "metric_name"), None),
        ("~grpo.seed=3", "delete", ("grpo", "seed"), 3),
    ],
)
def test_override_forms(text: str, op: str, key: tuple[str, ...], value: Any) -> None:
    override = parse_override(text)
    assert (override.op, override.key, override.value) == (op, key, value)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("policy.model_name", "missing '='"),
        ("=3", "the key is empty"),
        ("+=3", "the key is empty"),
        ("a..b=1", "invalid key"),
        ("a b=1", "invalid key"),
        ("+++a=1", "prefixes"),
        ("a=[1,2", "unclosed '\\['"),
        ("a=[1]]", "unexpected '\\]'"),
        ("a={b 1}", "key: value"),
        ("a={b: 1", "unclosed '\\{'"),
        ("a='abc", "unterminated"),
        ("a=1,2", "sweep"),
        ("a=choice(1,2)", "function calls"),
        ("a=b=c", "unexpected '='"),
        ("a=#x", "not allowed"),
        ("db/mysql=x", "config-group"),
    ],
)
def test_malformed_overrides_explain_the_grammar(text: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment) as info:
        parse_override(text)
    assert repr(text) in str(info.value) and "key=value" in str(info.value)


@pytest.mark.parametrize("text", ["it's", "a\\", "a\\'b", "x,y=z [1]", "/tmp/run (1)/é#~", ""])
def test_quote_override_value_round_trips(text: str) -> None:
    assert parse_override(f"k={quote_override_value(text)}").value == text


def test_apply_sets_keys_absent_from_the_file_and_leaves_input_untouched() -> None:
    raw = {"policy": {"model_name": "m"}}
    out = apply_overrides(raw, ["policy.generation.colocated.enabled=false", "grpo.seed=3"])
    assert out["policy"]["generation"] == {"colocated": {"enabled": False}}
    assert out["grpo"] == {"seed": 3}
    assert raw == {"policy": {"model_name": "m"}}
    assert validate_config(out).policy.generation.colocated.enabled is False


def test_apply_add_and_force_behave_like_set() -> None:
    out = apply_overrides({"grpo": {"seed": 1}}, ["+grpo.seed=2", "++grpo.max_num_steps=4", "+sft.seed=5"])
    assert out == {"grpo": {"seed": 2, "max_num_steps": 4}, "sft": {"seed": 5}}
    assert apply_overrides({}, ["grpo.seed=1", "grpo.seed=2"]) == {"grpo": {"seed": 2}}  # in order


def test_apply_delete_restores_the_schema_default() -> None:
    out = apply_overrides({"grpo": {"seed": 1, "max_num_steps": 3}}, ["~grpo.seed"])
    assert out == {"grpo": {"max_num_steps": 3}}
    assert validate_config(out).grpo.seed == MasterConfig().grpo.seed
    assert apply_overrides({"grpo": {"seed": 1}, "sft": {}}, ["~grpo.seed=1", "~sft"]) == {"grpo": {}}


def test_apply_delete_with_other_value_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"grpo\.seed is 1, not 2"):
        apply_overrides({"grpo": {"seed": 1}}, ["~grpo.seed=2"])


@pytest.mark.parametrize("override", ["~grpo.seed", "~policy.generation.top_k"])
def test_apply_delete_missing_key_is_an_error(override: str) -> None:
    with pytest.raises(ConfigError, match="not in the config"):
        apply_overrides({"grpo": {}}, [override])


def test_apply_dict_value_merges_into_existing_dict() -> None:
    out = apply_overrides(
        {"policy": {"model_name": "m", "precision": "float32"}}, ["policy={precision: bfloat16}"]
    )
    assert out == {"policy": {"model_name": "m", "precision": "bfloat16"}}


def test_apply_list_value_replaces_and_index_sets_an_item() -> None:
    raw = {"data": {"arithmetic": {"operations": ["+", "-"]}}}
    assert apply_overrides(raw, ["data.arithmetic.operations=['*']"]) == {
        "data": {"arithmetic": {"operations": ["*"]}}
    }
    assert apply_overrides(raw, ["data.arithmetic.operations.1=*"])["data"]["arithmetic"] == {
        "operations": ["+", "*"]
    }
    with pytest.raises(ConfigError, match="not a valid index"):
        apply_overrides(raw, ["data.arithmetic.operations.5=x", "data.arithmetic.operations.x=1"])
    with pytest.raises(ConfigError, match=r"data\.arithmetic\.operations\.0 is '\+' \(str\), not a mapping"):
        apply_overrides(raw, ["data.arithmetic.operations.0.x=1"])


def test_apply_reports_every_bad_override() -> None:
    with pytest.raises(ConfigError) as info:
        apply_overrides({}, ["grpo.seed", "grpo.seed=1", "~sft.seed", "a=[1"])
    assert len(info.value.problems) == 3
    assert (
        "'grpo.seed'" in str(info.value) and "'~sft.seed'" in str(info.value) and "'a=[1'" in str(info.value)
    )


def test_load_recipe_with_overrides(tmp_path: Path) -> None:
    write(tmp_path / "base.yaml", "policy:\n  model_name: base\n  optimizer:\n    kwargs:\n      lr: 1e-3\n")
    child = write(tmp_path / "child.yaml", "defaults: base.yaml\ngrpo:\n  seed: 1\n")
    cfg = load_recipe(child, ["policy.optimizer.kwargs.lr=1e-5", "grpo.max_num_steps=7", "~grpo.seed"])
    assert cfg.policy.model_name == "base"
    assert cfg.policy.optimizer.kwargs.lr == pytest.approx(1e-5)
    assert cfg.grpo.max_num_steps == 7 and cfg.grpo.seed == MasterConfig().grpo.seed


def test_load_recipe_error_names_the_recipe(tmp_path: Path) -> None:
    recipe = write(tmp_path / "r.yaml", "policy:\n  modle_name: x\n")
    with pytest.raises(ConfigError, match=r"recipe .*r\.yaml is invalid.*\n.*policy\.modle_name"):
        load_recipe(recipe)
    with pytest.raises(ConfigError, match="with its command-line overrides"):
        load_recipe(recipe, ["grpo.seed=1"])


# -------------------------------------------------------------------------------------- cross-field checks


@pytest.mark.parametrize("algorithm", ["grpo", "sft"])
def test_good_config_passes_checks(algorithm: str) -> None:
    check_config(validate_config(good_raw()), algorithm)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("overrides", "algorithm", "fragments"),
    [
        (["policy.model_name="], "sft", ["policy.model_name: got ''"]),
        (["policy.model_name='  '"], "grpo", ["policy.model_name"]),
        (
            ["grpo.num_prompts_per_step=3", "grpo.num_generations_per_prompt=5"],
            "grpo",
            ["3 * 5 = 15", "policy.train_global_batch_size=32", "divisor of 15"],
        ),
        (["policy.train_micro_batch_size=5"], "sft", ["policy.train_micro_batch_size=5", "divisor of 32"]),
        (["policy.generation.max_new_tokens=256"], "grpo", ["policy.generation.max_new_tokens=256"]),
        (["checkpointing.metric_name=val:rewards"], "grpo", ["checkpointing.metric_name: got 'val:rewards'"]),
        (["checkpointing.metric_name=train/kl"], "sft", ["checkpointing.metric_name: got 'train/kl'"]),
        (
            ["grpo.num_generations_per_prompt=1", "grpo.num_prompts_per_step=32"],
            "grpo",
            ["grpo.use_leave_one_out_baseline", "num_generations_per_prompt >= 2"],
        ),
        (
            [
                "policy.generation.colocated.enabled=false",
                "policy.generation.colocated.resources.num_nodes=1",
            ],
            "grpo",
            ["policy.generation.colocated.resources.gpus_per_node: got None"],
        ),
        (
            [
                "dpo.sampled_pairs.reward_shaping.enabled=true",
                "dpo.sampled_pairs.reward_shaping.overlong_buffer_length=100",
            ],
            "dpo",
            ["dpo.sampled_pairs.reward_shaping.overlong_buffer_length=100 exceeds the response limit 64"],
        ),
        (
            [
                "dpo.sampled_pairs.reward_shaping.enabled=true",
                "dpo.sampled_pairs.reward_shaping.max_response_length=512",
            ],
            "dpo",
            ["so it would never apply", "fix: dpo.sampled_pairs.reward_shaping.max_response_length=null"],
        ),
    ],
)
def test_each_cross_field_check_names_its_key(
    overrides: list[str], algorithm: str, fragments: list[str]
) -> None:
    cfg = validate_config(apply_overrides(good_raw(), overrides))
    with pytest.raises(ConfigError) as info:
        check_config(cfg, algorithm)  # type: ignore[arg-type]
    assert len(info.value.problems) == 1, str(info.value)
    for fragment in fragments:
        assert fragment in str(info.value)


RM_RAW = [
    "policy.reward_model_cfg.enabled=true",
    "data.dataset_name=BinaryPreferenceDataset",
    "data.train_data_path=pairs.jsonl",
    "data.val_data_path=pairs.jsonl",
]


@pytest.mark.parametrize(
    ("overrides", "algorithm", "fragment"),
    [
        (["policy.reward_model_cfg.enabled=false"], "rm", "`rlfleet rm` trains the model loaded as a reward"),
        (["policy.reward_model_cfg.reward_model_type=regression"], "rm", "got 'regression'"),
        (["data.dataset_name=arithmetic"], "rm", "data.dataset_name: arithmetic is a task"),
        (["policy.dtensor_cfg.lora_cfg.enabled=true"], "rm", "new score head would stay at its random start"),
        (
            ["policy.logprob_chunk_size=64"],
            "rm",
            "policy.logprob_chunk_size=64: a reward model has one score",
        ),
        (
            [
                "policy.generation.colocated.enabled=false",
                "policy.generation.colocated.resources.num_nodes=1",
                "policy.generation.colocated.resources.gpus_per_node=1",
                "cluster.gpus_per_node=2",
            ],
            "rm",
            "a reward model generates nothing, so they would stay idle",
        ),
        (
            [
                "cluster.gpus_per_node=2",
                "policy.train_global_batch_size=3",
                "policy.train_micro_batch_size=1",
            ],
            "rm",
            "3 pairs do not split over the 2 data-parallel",
        ),
        (
            ["checkpointing.metric_name=val:reward"],
            "rm",
            "rm logs only train/accuracy, train/loss, val/accuracy",
        ),
        ([], "grpo", "policy.reward_model_cfg.enabled=true loads the model as a reward model"),
        (["policy.reward_model_cfg.enabled=false"], "sft", "is preference data"),
        (["data.train_data_path=runs/demo/rm/pairs/train.jsonl"], "rm", "`rlfleet data arithmetic-pairs"),
        (
            ["policy.reward_model_cfg.enabled=false", "dpo.sampled_pairs.reward_shaping.enabled=true"],
            "dpo",
            "ranks the model's own samples, but data.dataset_name=BinaryPreferenceDataset gives the pairs",
        ),
    ],
)
def test_reward_model_checks_name_their_key(
    overrides: list[str], algorithm: str, fragment: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # runs/demo/rm/pairs is not written here
    check_config(validate_config(apply_overrides(good_raw(), RM_RAW)), "rm")
    cfg = validate_config(apply_overrides(good_raw(), [*RM_RAW, *overrides]))
    with pytest.raises(ConfigError) as info:
        check_config(cfg, algorithm)  # type: ignore[arg-type]
    assert fragment in str(info.value)
    # grpo: the preference data and the reward model; 3 pairs over 2 ranks: the data-parallel check too
    expected = 1 + (algorithm == "grpo") + ("policy.train_global_batch_size=3" in overrides)
    assert len(info.value.problems) == expected, str(info.value)


def test_checks_report_all_problems_at_once() -> None:
    overrides = [
        "policy.model_name=",
        "policy.train_micro_batch_size=5",
        "policy.generation.max_new_tokens=300",
        "checkpointing.metric_name=nope",
        "policy.generation.colocated.enabled=false",
    ]
    with pytest.raises(ConfigError) as info:
        check_config(validate_config(apply_overrides(good_raw(), overrides)), "grpo")
    assert len(info.value.problems) == 6  # the two missing resources are separate problems


def test_grpo_only_checks_are_skipped_for_sft() -> None:
    overrides = [
        "grpo.num_prompts_per_step=3",
        "grpo.num_generations_per_prompt=1",
        "policy.generation.max_new_tokens=900",
    ]
    check_config(validate_config(apply_overrides(good_raw(), overrides)), "sft")


@pytest.mark.parametrize(
    "overrides",
    [["checkpointing.keep_top_k=null"], ["checkpointing.enabled=false"], ["checkpointing.metric_name=null"]],
)
def test_metric_name_unchecked_when_unused(overrides: list[str]) -> None:
    check_config(
        validate_config(apply_overrides(good_raw(), ["checkpointing.metric_name=bogus", *overrides])), "grpo"
    )


@pytest.mark.parametrize("name", ["val:accuracy", "val/accuracy", "train:kl", "val:mean_response_length"])
def test_metric_name_separator_is_normalised(name: str) -> None:
    normalized = normalize_metric_name(name)
    assert normalized in algorithm_spec("grpo").metrics and "/" in normalized
    check_config(validate_config(apply_overrides(good_raw(), [f"checkpointing.metric_name={name}"])), "grpo")


def test_contradictions_that_bypass_validation_are_still_refused() -> None:
    cfg = validate_config(good_raw())
    cfg.eval.pass_k_value = 3  # assignment checks the field alone
    with pytest.raises(ConfigError, match=r"\(1 problem\(s\)\):\n  - eval: eval.pass_k_value=3 exceeds"):
        check_config(cfg, "sft")


def test_checks_use_the_layout_they_are_given() -> None:
    import dataclasses

    from rlfleet.config.capabilities import uses_ray
    from rlfleet.config.layout import resource_layout

    cfg = validate_config(good_raw())
    one = resource_layout(cfg)
    check_config(cfg, "grpo", layout=one)
    assert not uses_ray(cfg, layout=one)
    eight = dataclasses.replace(one, gpus_per_node=8, train_gpus_per_node=8, gen_gpus_per_node=8)
    with pytest.raises(ConfigError, match="data-parallel size 8"):
        check_config(cfg, "grpo", layout=eight)
    assert uses_ray(cfg, layout=eight)


def test_unknown_algorithm_is_an_error() -> None:
    with pytest.raises(ConfigError, match="algorithm: got 'ppo'"):
        check_config(validate_config(good_raw()), "ppo")  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------- recipe lookup


def test_resolve_existing_path_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shipped = write(tmp_path / "shipped" / "r.yaml", "{}\n").parent
    local = write(tmp_path / "r.yaml", "{}\n")
    monkeypatch.setattr(loader_module, "shipped_recipe_dirs", lambda: [shipped])
    monkeypatch.chdir(tmp_path)
    assert resolve_recipe_path("r.yaml") == local.resolve()


@pytest.mark.parametrize("name", ["grpo-demo", "grpo-demo.yaml"])
def test_resolve_shipped_recipe_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    recipe = write(tmp_path / "shipped" / "grpo-demo.yaml", "{}\n")
    monkeypatch.setattr(loader_module, "shipped_recipe_dirs", lambda: [recipe.parent])
    monkeypatch.chdir(tmp_path)
    assert resolve_recipe_path(name) == recipe.resolve()


def test_resolve_unknown_recipe_lists_shipped_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shipped = tmp_path / "shipped"
    write(shipped / "grpo-demo.yaml", "{}\n")
    write(shipped / "sft-demo.yaml", "{}\n")
    monkeypatch.setattr(loader_module, "shipped_recipe_dirs", lambda: [shipped])
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as info:
        resolve_recipe_path("grpo-dmeo")
    message = str(info.value)
    assert (
        "'grpo-dmeo'" in message and "grpo-demo, sft-demo" in message and "Did you mean grpo-demo" in message
    )


def test_shipped_recipe_dirs_checkout_then_wheel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "src" / "rlfleet"
    monkeypatch.setattr(rlfleet, "__file__", str(package / "__init__.py"))
    assert loader_module.shipped_recipe_dirs() == []
    write(package / "_recipes" / "wheel.yaml", "{}\n")
    write(tmp_path / "recipes" / "repo.yaml", "{}\n")
    dirs = loader_module.shipped_recipe_dirs()
    assert dirs == [(tmp_path / "recipes").resolve(), (package / "_recipes").resolve()]
    assert resolve_recipe_path("wheel") == (package / "_recipes" / "wheel.yaml").resolve()


def test_resolve_directory_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is a directory"):
        resolve_recipe_path(tmp_path)


def test_config_to_yaml_round_trips(tmp_path: Path) -> None:
    cfg = validate_config(
        apply_overrides(good_raw(), ["policy.optimizer.kwargs.lr=1e-5", "data.arithmetic.operations=['*']"])
    )
    text = config_to_yaml(cfg)
    assert text.startswith("grpo:")  # schema order, not sorted
    assert validate_config(yaml.safe_load(text)) == cfg
    assert load_recipe(write(tmp_path / "dump.yaml", text)) == cfg


def test_schema_keys_are_dotted_leaves() -> None:
    keys = schema_keys()
    assert "policy.optimizer.kwargs.lr" in keys and "policy.generation.colocated.resources.num_nodes" in keys
    assert "grpo.num_prompts_per_step" in keys and "data.arithmetic.operations" in keys
    assert "policy" not in keys and "policy.generation" not in keys
    assert len(keys) == len(set(keys))
    for key in keys:  # every key is addressable by an override
        assert parse_override(f"{key}=1").key == tuple(key.split("."))


def test_settings_this_build_cannot_honour_are_refused_not_ignored() -> None:
    from rlfleet.config import ensure_runnable, load_recipe, resolve_recipe_path

    path = resolve_recipe_path("grpo-tiny-arithmetic-cpu")
    base = ["policy.model_name=x"]
    ensure_runnable(load_recipe(path, base))
    ensure_runnable(load_recipe(path, [*base, "cluster.gpus_per_node=8"]))  # runs on Ray
    ensure_runnable(
        load_recipe(
            path,
            [
                *base,
                "cluster.gpus_per_node=2",
                "policy.generation.colocated.enabled=false",
                "policy.generation.colocated.resources.gpus_per_node=1",
                "policy.generation.colocated.resources.num_nodes=1",
            ],
        )
    )
    for overrides, key in [
        (["cluster.gpus_per_node=2", "cluster.use_ray=false"], "cluster.use_ray"),
        (["policy.dtensor_cfg.cpu_offload=true"], "policy.dtensor_cfg.cpu_offload"),
        (["policy.dtensor_cfg.sequence_parallel=true"], "policy.dtensor_cfg.sequence_parallel"),
        (["policy.generation.backend=vllm", "policy.generation.vllm_cfg.async_engine=true"], "async_engine"),
        (["policy.generation.backend=vllm", "policy.generation.top_p=0.9"], "top_p=0.9"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(key)):
            ensure_runnable(load_recipe(path, [*base, *overrides]))


def test_ray_is_used_when_the_layout_needs_more_than_one_process() -> None:
    from rlfleet.config import load_recipe, resolve_recipe_path
    from rlfleet.config.capabilities import uses_ray

    path = resolve_recipe_path("grpo-tiny-arithmetic-cpu")
    assert not uses_ray(load_recipe(path, []))
    assert uses_ray(load_recipe(path, ["cluster.use_ray=true"]))
    assert uses_ray(load_recipe(path, ["cluster.gpus_per_node=2"]))
    dedicated = [
        "cluster.gpus_per_node=2",
        "policy.generation.colocated.enabled=false",
        "policy.generation.colocated.resources.gpus_per_node=1",
        "policy.generation.colocated.resources.num_nodes=1",
        "cluster.use_ray=null",
    ]
    assert uses_ray(load_recipe(path, dedicated))


def test_vllm_runs_in_one_process_and_on_ray_and_bad_tensor_parallel_sizes_are_refused_with_a_fix() -> None:
    from rlfleet.config import check_config, ensure_runnable, load_recipe, resolve_recipe_path

    path = resolve_recipe_path("grpo-tiny-arithmetic-cpu")
    vllm = ["policy.model_name=x", "policy.generation.backend=vllm"]
    dedicated = [
        "cluster.gpus_per_node=4",
        "policy.generation.colocated.enabled=false",
        "policy.generation.colocated.resources.num_nodes=1",
        "policy.generation.colocated.resources.gpus_per_node=2",
    ]
    for layout in ([], ["cluster.gpus_per_node=2"], ["cluster.use_ray=true"], dedicated):
        cfg = load_recipe(path, [*vllm, *layout])
        check_config(cfg, "grpo")
        ensure_runnable(cfg)  # one process, colocated on Ray, dedicated on Ray: runnable
    tp2 = "policy.generation.vllm_cfg.tensor_parallel_size=2"
    ensure_runnable(load_recipe(path, [*vllm, *dedicated, tp2]))  # one engine of 2 GPUs
    with pytest.raises(ConfigError, match=r"(?s)1 problem.*vllm_cfg.tensor_parallel_size=2 must divide"):
        check_config(load_recipe(path, [*vllm, tp2]), "grpo")  # one process on one GPU
    with pytest.raises(ConfigError, match=r"(?s)1 problem.*tensor_parallel_size=4 must divide the 2 GPUs"):
        tp4 = "policy.generation.vllm_cfg.tensor_parallel_size=4"
        check_config(load_recipe(path, [*vllm, *dedicated, tp4]), "grpo")
    colocated = ["cluster.gpus_per_node=2", tp2]  # one engine over both training ranks' GPUs
    ensure_runnable(load_recipe(path, [*vllm, *colocated]))
    check_config(load_recipe(path, [*vllm, *colocated]), "grpo")
    with pytest.raises(ConfigError, match=r"(?s)1 problem.*tensor_parallel_size=2 must divide the 3 GPUs"):
        check_config(load_recipe(path, [*vllm, "cluster.gpus_per_node=3", tp2]), "grpo")


def test_vllm_max_model_len_below_the_sequence_budget_is_one_error_before_anything_starts() -> None:
    from rlfleet.config import check_config, load_recipe, resolve_recipe_path

    path = resolve_recipe_path("grpo-tiny-arithmetic-cpu")
    base = ["policy.model_name=x", "policy.generation.backend=vllm", "policy.max_total_sequence_length=256"]
    check_config(load_recipe(path, [*base, "policy.generation.vllm_cfg.max_model_len=256"]), "grpo")
    with pytest.raises(ConfigError) as err:
        check_config(load_recipe(path, [*base, "policy.generation.vllm_cfg.max_model_len=128"]), "grpo")
    message = str(err.value)
    assert "(1 problem(s))" in message
    assert "max_model_len=128 is shorter than policy.max_total_sequence_length=256" in message
    assert "fix: policy.generation.vllm_cfg.max_model_len=256" in message


def test_vllm_cfg_keys_resolve_into_the_engine_settings() -> None:
    from rlfleet.config import load_recipe, resolve_recipe_path
    from rlfleet.runtime.components import vllm_settings

    path = resolve_recipe_path("grpo-tiny-arithmetic-cpu")
    cfg = load_recipe(path, ["policy.model_name=x", "policy.max_total_sequence_length=300"])
    s = vllm_settings(cfg, seed=7)
    assert (s.precision, s.max_model_len, s.seed, s.load_format, s.engine_kwargs) == (
        cfg.policy.precision,
        300,
        7,
        "auto",
        {},
    )
    v = "policy.generation.vllm_cfg"
    cfg = load_recipe(
        path,
        [
            "policy.model_name=x",
            f"{v}.precision=bfloat16",
            f"{v}.max_model_len=1024",
            f"{v}.load_format=dummy",
            f"{v}.enforce_eager=true",
            f"{v}.gpu_memory_utilization=0.3",
            f"+{v}.vllm_kwargs.swap_space=2",
        ],
    )
    s = vllm_settings(cfg, seed=0)
    assert (s.precision, s.max_model_len, s.load_format, s.enforce_eager) == ("bfloat16", 1024, "dummy", True)
    assert (s.gpu_memory_utilization, s.engine_kwargs) == (0.3, {"swap_space": 2})


def test_packages_missing_here_are_no_problem_for_a_run_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """``rlfleet k8s render`` checks the recipe, not the rendering machine's packages (the image has them)."""
    import importlib.util

    from rlfleet.config import load_recipe, resolve_recipe_path, unsupported_settings

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in ("ray", "vllm") else real(name)
    )
    cfg = load_recipe(
        resolve_recipe_path("grpo-tiny-arithmetic-cpu"),
        ["policy.model_name=x", "policy.generation.backend=vllm", "cluster.gpus_per_node=2"],
    )
    here = unsupported_settings(cfg)
    assert len(here) == 2 and "ray is not installed" in here[0] and "vllm is not installed" in here[1]
    assert unsupported_settings(cfg, here=False) == []
