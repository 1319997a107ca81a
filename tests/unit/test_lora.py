"""LoRA maths and targeting without a pretrained model: the layer, its merge, module selection, config."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rlfleet.config import ConfigError, load_recipe, resolve_recipe_path, unsupported_settings
from rlfleet.config.schema import MasterConfig
from rlfleet.generation.weights import engine_state
from rlfleet.memory.planner import count_lora_parameters, count_parameters
from rlfleet.memory.report import format_plan, make_plan
from rlfleet.models.lora import (
    LoRALinear,
    LoraSettings,
    LoraTargetError,
    WithoutAdapters,
    adapter_parameter_count,
    adapter_state,
    adapters_disabled,
    apply_lora,
    linear_shapes,
    matches,
    merge_adapters,
    select_targets,
)

SETTINGS = LoraSettings(dim=4, alpha=8.0)


def _layer(seed: int = 0, bias: bool = True, **kw: object) -> tuple[nn.Linear, LoRALinear]:
    torch.manual_seed(seed)
    base = nn.Linear(12, 7, bias=bias)
    return base, LoRALinear.from_linear(base, LoraSettings(dim=4, alpha=8.0, **kw))  # type: ignore[arg-type]


def test_fresh_adapter_leaves_the_output_unchanged_and_shares_the_base_weights() -> None:
    base, layer = _layer()
    x = torch.randn(3, 5, 12)
    assert torch.equal(layer(x), base(x))  # B = 0: bit for bit
    assert layer.weight is base.weight and layer.bias is base.bias
    assert layer.lora_A.weight.shape == (4, 12) and layer.lora_B.weight.shape == (7, 4)
    assert layer.lora_A.weight.abs().sum() > 0 and layer.lora_B.weight.abs().sum() == 0
    assert layer.lora_A.weight.dtype == torch.float32


def test_adapted_forward_is_base_plus_scaled_low_rank_update_and_merges_exactly() -> None:
    base, layer = _layer()
    with torch.no_grad():
        layer.lora_B.weight.normal_()
    x = torch.randn(3, 5, 12, dtype=torch.float64)
    w, b = base.weight.double(), base.bias.double()
    a, bb = layer.lora_A.weight.double(), layer.lora_B.weight.double()
    expected = x @ w.T + b + 2.0 * (x @ a.T) @ bb.T  # float64 reference, scaling = 8 / 4
    torch.testing.assert_close(layer(x.float()).double(), expected, rtol=1e-5, atol=1e-5)
    merged = merge_adapters(layer.state_dict(), scaling=2.0)
    assert set(merged) == {"weight", "bias"}
    # the merge is W + s * B A in float32: equal to the float64 sum rounded once (up to float32 epsilon)
    torch.testing.assert_close(merged["weight"].double(), w + 2.0 * bb @ a, rtol=2e-7, atol=1e-7)
    merged_out = nn.functional.linear(x, merged["weight"].double(), b)
    torch.testing.assert_close(merged_out, expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(merged["bias"], base.bias)


def test_disabled_adapters_give_the_base_output_and_are_restored() -> None:
    base, layer = _layer()
    with torch.no_grad():
        layer.lora_B.weight.normal_()
    x = torch.randn(2, 12)
    assert not torch.equal(layer(x), base(x))
    with adapters_disabled(layer):
        assert torch.equal(layer(x), base(x))
    assert layer.adapters_enabled and not torch.equal(layer(x), base(x))


@pytest.mark.parametrize("position", ["pre", "post"])
def test_dropout_acts_in_training_only(position: str) -> None:
    _, layer = _layer(dropout=0.5, dropout_position=position)
    with torch.no_grad():
        layer.lora_B.weight.normal_()
    x = torch.randn(4, 12)
    layer.eval()
    assert torch.equal(layer(x), layer(x))
    layer.train()
    torch.manual_seed(1)
    first = layer(x)
    assert not torch.equal(first, layer(x))


def test_uniform_init_differs_from_xavier() -> None:
    _, xavier = _layer(seed=3)
    _, uniform = _layer(seed=3, lora_A_init="uniform")
    bound = 1 / 12**0.5  # Kaiming uniform with a = sqrt(5): U(-1/sqrt(in), 1/sqrt(in))
    assert uniform.lora_A.weight.abs().max() <= bound
    assert not torch.equal(xavier.lora_A.weight, uniform.lora_A.weight)


class _Tiny(nn.Module):
    """Two blocks of q/v projections and an mlp, an embedding and a tied lm_head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.layers = nn.ModuleList(
            nn.ModuleDict({"q_proj": nn.Linear(8, 8), "v_proj": nn.Linear(8, 8), "mlp": nn.Linear(8, 8)})
            for _ in range(2)
        )
        self.lm_head = nn.Linear(8, 10, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.layers:
            h = h + block["mlp"](block["q_proj"](h) * block["v_proj"](h))
        return self.lm_head(h)


LINEARS = [f"layers.{i}.{n}" for i in range(2) for n in ("q_proj", "v_proj", "mlp")] + ["lm_head"]


def test_pattern_matching_by_suffix_full_name_and_wildcard() -> None:
    assert matches("q_proj", "layers.0.q_proj") and matches("layers.0.q_proj", "layers.0.q_proj")
    assert not matches("proj", "layers.0.q_proj")  # a suffix is whole dotted components
    assert matches("layers.1.*", "layers.1.mlp") and not matches("layers.1.*", "layers.0.mlp")
    assert matches("*_proj", "layers.0.v_proj") and not matches("*_proj", "layers.0.mlp")


def test_select_targets_all_linear_skips_tied_and_excluded() -> None:
    tied = {"lm_head"}
    assert select_targets(LINEARS, tied, SETTINGS) == LINEARS[:-1]
    only = LoraSettings(dim=4, alpha=8, exclude_modules=("mlp",))
    assert select_targets(LINEARS, tied, only) == [n for n in LINEARS[:-1] if not n.endswith("mlp")]
    named = LoraSettings(dim=4, alpha=8, match_all_linear=False, target_modules=("q_proj", "layers.1.mlp"))
    assert select_targets(LINEARS, tied, named) == ["layers.0.q_proj", "layers.1.q_proj", "layers.1.mlp"]
    untied = LoraSettings(dim=4, alpha=8, match_all_linear=False, target_modules=("lm_head",))
    assert select_targets(LINEARS, set(), untied) == ["lm_head"]


def test_select_targets_names_unknown_modules_and_lists_candidates() -> None:
    bad = LoraSettings(dim=4, alpha=8, match_all_linear=False, target_modules=("q_proj", "k_proj"))
    with pytest.raises(LoraTargetError, match=r"\['k_proj'\] match no linear.*\['lm_head', 'mlp', 'q_proj'"):
        select_targets(LINEARS, {"lm_head"}, bad)
    with pytest.raises(LoraTargetError, match=r"\['o_proj'\] match no linear"):
        select_targets(LINEARS, set(), LoraSettings(dim=4, alpha=8, exclude_modules=("o_proj",)))
    tied = LoraSettings(dim=4, alpha=8, match_all_linear=False, target_modules=("lm_head",))
    with pytest.raises(LoraTargetError, match="tied to another module"):
        select_targets(LINEARS, {"lm_head"}, tied)
    nothing = LoraSettings(
        dim=4, alpha=8, match_all_linear=False, target_modules=("mlp",), exclude_modules=("mlp",)
    )
    with pytest.raises(LoraTargetError, match="selects no linear layer"):
        select_targets(LINEARS, set(), nothing)


def test_apply_lora_freezes_the_base_and_the_engine_state_has_base_names_only() -> None:
    torch.manual_seed(0)
    model = _Tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.tensor([[1, 2, 3]])
    out = model(ids)
    assert apply_lora(model, SETTINGS) == LINEARS[:-1]
    assert not isinstance(model.lm_head, LoRALinear)  # tied to the embedding
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"{n}.lora_{x}.weight" for n in LINEARS[:-1] for x in "AB"}
    assert torch.equal(model(ids), out)
    with pytest.raises(ValueError, match="already has LoRA"):
        apply_lora(model, SETTINGS)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B.weight"):
                p.normal_(std=0.1)
    adapted = model(ids)
    merged = engine_state(model)  # what generation engines load: the adapters merged
    assert set(merged) == set(before) and set(adapter_state(model.state_dict())) == trainable
    plain = _Tiny()
    plain.load_state_dict(merged)
    assert not torch.allclose(adapted, out, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(plain(ids), adapted, rtol=1e-5, atol=1e-5)
    reference = WithoutAdapters(model)
    assert torch.equal(reference(ids), out)  # the base weights alone
    model.eval()
    assert reference.training is False
    reference.train()
    assert model.training


def test_merge_of_a_state_dict_without_adapters_is_a_copy_and_a_lone_b_is_refused() -> None:
    state = {"w.weight": torch.ones(2, 2)}
    assert merge_adapters(state, 2.0) == state
    with pytest.raises(KeyError, match="without their other half"):
        merge_adapters({"w.weight": torch.ones(2, 2), "w.lora_B.weight": torch.ones(2, 1)}, 2.0)


# --------------------------------------------------------------------------------------------- config


def _cfg(*overrides: str) -> MasterConfig:
    return load_recipe(resolve_recipe_path("grpo-smollm2-135m-gsm8k-cpu"), list(overrides))


def test_lora_config_cross_field_errors_name_the_key_and_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"target_modules=\['q_proj'\] with match_all_linear=true.*fix"):
        _cfg(
            "policy.dtensor_cfg.lora_cfg.enabled=true", "policy.dtensor_cfg.lora_cfg.target_modules=[q_proj]"
        )
    with pytest.raises(ConfigError, match="no layer would be adapted; fix"):
        _cfg("policy.dtensor_cfg.lora_cfg.enabled=true", "policy.dtensor_cfg.lora_cfg.match_all_linear=false")
    cfg = _cfg(
        "policy.dtensor_cfg.lora_cfg.enabled=true",
        "policy.dtensor_cfg.lora_cfg.match_all_linear=false",
        "policy.dtensor_cfg.lora_cfg.target_modules=[q_proj,v_proj]",
    )
    assert cfg.policy.dtensor_cfg.lora_cfg.target_modules == ["q_proj", "v_proj"]


def test_lora_with_tensor_parallelism_is_refused_with_a_fix() -> None:
    cfg = _cfg("policy.dtensor_cfg.lora_cfg.enabled=true")
    assert not [p for p in unsupported_settings(cfg) if "lora" in p]
    cfg.policy.dtensor_cfg.tensor_parallel_size = 2
    (problem,) = [p for p in unsupported_settings(cfg) if "lora_cfg" in p]
    assert "tensor_parallel_size=2" in problem and "fix: policy.dtensor_cfg.tensor_parallel_size=1" in problem


SMOLLM2 = dict(hidden=576, heads=9, kv_heads=3, head_dim=64, intermediate=1536, layers=30, vocab=49152)


def test_smollm2_135m_lora_counts_and_plan() -> None:
    shapes = linear_shapes(**SMOLLM2)
    targets = select_targets(list(shapes), {"lm_head"}, LoraSettings(dim=8, alpha=32))
    # per layer r * (in + out): q, o 2 x 8 x 1152; k, v 2 x 8 x 768; gate, up, down 3 x 8 x 2112
    assert adapter_parameter_count(shapes, targets, 8) == 30 * 81_408 == 2_442_240
    cfg = _cfg("policy.dtensor_cfg.lora_cfg.enabled=true")
    assert cfg.policy.architecture is not None and cfg.policy.architecture.hidden_size == 576
    assert count_lora_parameters(cfg) == 2_442_240
    plan, problems = make_plan(cfg)
    assert problems == [] and plan.parameters == count_parameters(cfg.policy.architecture)
    assert plan.trainable_parameters == 2_442_240
    mem = plan.training_memory_gib()
    assert mem["optimizer (AdamW m, v fp32)"] == pytest.approx(8 * 2_442_240 / 1024**3)
    text = format_plan(cfg, plan, "smollm2")
    assert "LoRA" in text and "2,442,240 trainable parameters" in text
    bad = _cfg(
        "policy.dtensor_cfg.lora_cfg.enabled=true",
        "policy.dtensor_cfg.lora_cfg.match_all_linear=false",
        "policy.dtensor_cfg.lora_cfg.target_modules=[qkv]",
    )
    _, problems = make_plan(bad)
    assert any("['qkv'] match no linear" in p for p in problems)
