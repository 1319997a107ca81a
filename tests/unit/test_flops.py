"""Model FLOPs and MFU: hand-computed values."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rlfleet.utils.flops import (
    ModelShape,
    forward_flops,
    mfu,
    model_shape,
    peak_flops,
    shape_from_config,
    training_flops,
)


def test_forward_flops_by_hand() -> None:
    shape = ModelShape(matmul_parameters=1000, num_layers=2, attention_dim=8)
    # length 3: weights 2*1000*3 = 6000; attention 4 * 2 layers * 8 * (1 + 2 + 3) = 384
    assert forward_flops(shape, [3]) == 6000 + 384
    assert forward_flops(shape, [3, 3]) == 2 * (6000 + 384)
    assert training_flops(shape, [3]) == 3 * (6000 + 384)
    assert forward_flops(shape, []) == 0


def test_model_shape_counts_each_linear_weight_once() -> None:
    shared = nn.Linear(4, 6, bias=True)
    model = nn.Sequential(nn.Embedding(10, 4), shared, nn.ReLU(), nn.Linear(6, 10, bias=False), shared)
    assert model_shape(model, 1, 4).matmul_parameters == 4 * 6 + 6 * 10  # biases and embeddings excluded


def test_shape_from_config_on_a_tiny_llama() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=50,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    shape = shape_from_config(LlamaForCausalLM(config))
    head_dim = 16 // 4
    per_layer = 16 * head_dim * (4 + 2 + 2 + 4) + 3 * 16 * 32
    assert shape == ModelShape(2 * per_layer + 50 * 16, 2, 16)


def test_peak_and_mfu() -> None:
    assert peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("NVIDIA GH200 480GB") == 989e12
    assert peak_flops("NVIDIA A100-SXM4-80GB", dtype_bits=32) == 156e12
    assert peak_flops("Intel Xeon") is None
    assert mfu(989e12, 2.0, 989e12) == 0.5
    assert mfu(989e12, 1.0, 989e12, devices=4) == 0.25
    with pytest.raises(ValueError, match="positive"):
        mfu(1.0, 0.0, 1.0)


def test_flop_meter_on_a_known_gpu(tiny_model_dir) -> None:
    from rlfleet.config import load_recipe, resolve_recipe_path
    from rlfleet.runtime.components import flop_meter
    from rlfleet.utils.flops import FlopMeter

    cfg = load_recipe(
        resolve_recipe_path("grpo-tiny-arithmetic-cpu"), [f"policy.model_name={tiny_model_dir}"]
    )

    class On:
        def __init__(self, name: str) -> None:
            self.name = name

        def accelerator_name(self) -> str:
            return self.name

    assert flop_meter(cfg, On("cpu")) is None  # type: ignore[arg-type]
    meter = flop_meter(cfg, On("NVIDIA H100 80GB HBM3"))  # type: ignore[arg-type]
    assert isinstance(meter, FlopMeter) and meter.peak == 989e12 / 2  # float32 recipe: the TF32 rate
    shape = meter.shape
    expected = 3 * forward_flops(shape, [10, 20]) + 2 * forward_flops(shape, [10, 20])
    assert meter.step_mfu([10, 20], 2, 1.0) == pytest.approx(expected / (989e12 / 2))
