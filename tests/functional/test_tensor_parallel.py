"""Tensor parallelism, activation checkpointing and FSDP2 (``rlfleet.policy.parallelize``) on gloo ranks.

Every distributed result is compared with the same computation on one unsharded model in this process.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig

from rlfleet.distributed.cluster import (
    create_node_placement_groups,
    remove_placement_groups,
)
from rlfleet.distributed.rank_group import RayRankGroup
from rlfleet.models.loading import load_model
from rlfleet.policy.parallelize import (
    build_mesh,
    check_tensor_parallel,
    clip_grad_norm,
    decoder_layers,
    parallelize,
    validate_tensor_parallel,
)

TIMEOUT_S = 120.0
LR = 1e-2
MAX_NORM = 0.5  # below the batch's gradient norm (about 1.7), so clipping scales the gradients
_TEXT = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 64,
}
_WINDOW = {**_TEXT, "sliding_window": 4}
_VISION = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
# (model class, config class, config kwargs): tiny models of each supported layout.
ARCHITECTURES = [
    ("Qwen2ForCausalLM", "Qwen2Config", _TEXT),
    ("Qwen3ForCausalLM", "Qwen3Config", _TEXT),
    ("MistralForCausalLM", "MistralConfig", _WINDOW),
    ("GemmaForCausalLM", "GemmaConfig", _TEXT),
    ("Gemma2ForCausalLM", "Gemma2Config", _WINDOW),
    ("Gemma3ForCausalLM", "Gemma3TextConfig", _WINDOW),
    (
        "Gemma3ForConditionalGeneration",  # decoder layers at model.model.language_model.layers
        "Gemma3Config",
        {"text_config": _WINDOW, "vision_config": {**_VISION, "image_size": 28, "patch_size": 14}},
    ),
]


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Four left-padded rows (padding 0, 3, 1 and 5 tokens) of random token ids."""
    ids = torch.randint(4, 300, (4, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    for row, pad in enumerate((0, 3, 1, 5)):
        ids[row, :pad], mask[row, :pad] = 0, 0
    return ids, mask


def _loss(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, num_tokens: float) -> torch.Tensor:
    """Next-token negative log-likelihood summed over real tokens, divided by the global token count."""
    logprobs = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    return -(logprobs * mask[:, 1:]).sum() / num_tokens


class ParallelProbe:
    """One rank: models parallelized over a ("dp", "tp") mesh, trained on this dp rank's rows of a batch."""

    def __init__(self, model_path: str, tensor_parallel_size: int) -> None:
        self.path = model_path
        self.mesh = build_mesh(tensor_parallel_size, "cpu")
        self.models: dict[str, Any] = {}
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self.attention_calls: dict[str, int] = {}

    def build(self, name: str, activation_checkpointing: bool) -> None:
        model = parallelize(
            load_model(self.path, "float32"), self.mesh, activation_checkpointing=activation_checkpointing
        )
        self.attention_calls[name] = 0

        def count(*_: Any) -> None:
            self.attention_calls[name] += 1

        decoder_layers(model)[0].self_attn.register_forward_hook(count)  # runs again when recomputed
        self.models[name] = model
        self.optimizers[name] = torch.optim.AdamW(model.parameters(), lr=LR)

    def step(self, name: str, ids: torch.Tensor, mask: torch.Tensor) -> dict[str, Any]:
        """Forward and backward of this dp rank's rows, clipping, one AdamW step; full logits and grads."""
        model, dp = self.models[name], self.mesh["dp"]
        share = len(ids) // dp.size()
        rows = slice(dp.get_local_rank() * share, (dp.get_local_rank() + 1) * share)
        logits = model(input_ids=ids[rows], attention_mask=mask[rows]).logits
        # FSDP2 averages gradients over dp ranks: scale so that they sum this rank's share of the loss.
        (_loss(logits, ids[rows], mask[rows], float(mask[:, 1:].sum())) * dp.size()).backward()
        norm = clip_grad_norm(model.parameters(), MAX_NORM)
        grads = {
            key: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
            for key, p in model.named_parameters()
        }
        self.optimizers[name].step()
        self.optimizers[name].zero_grad()
        return {"logits": logits.detach(), "norm": norm, "grads": grads, "calls": self.attention_calls[name]}

    def full_state_dict(self, name: str) -> dict[str, torch.Tensor]:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(self.models[name], options=options)

    @torch.no_grad()
    def architecture_logit_errors(self) -> dict[str, float]:
        """Largest logit difference, tensor-parallel vs unsharded, for a tiny model of each layout."""
        ids, mask = _batch()
        ids = ids % _TEXT["vocab_size"]
        errors = {}
        for model_name, config_name, kwargs in ARCHITECTURES:
            torch.manual_seed(0)  # the same weights on every rank
            model = getattr(transformers, model_name)(getattr(transformers, config_name)(**kwargs)).eval()
            expected = copy.deepcopy(model)(input_ids=ids, attention_mask=mask).logits
            parallelize(model, self.mesh, activation_checkpointing=True)
            got = model(input_ids=ids, attention_mask=mask).logits
            errors[model_name] = float((got - expected).abs().max())
        return errors

    def parallelize_error(self, num_key_value_heads: int) -> tuple[str, bool]:
        """The error of parallelizing the model with other kv heads, and whether it left the model intact."""
        config = transformers.AutoConfig.from_pretrained(self.path, num_key_value_heads=num_key_value_heads)
        model = transformers.AutoModelForCausalLM.from_config(config)
        try:
            parallelize(model, self.mesh, activation_checkpointing=True)
        except ValueError as exc:
            intact = not any(isinstance(p, DTensor) for p in model.parameters())
            return str(exc), intact and "forward" not in vars(decoder_layers(model)[0])
        return "", False

    def mesh_groups(self) -> tuple[list[int], list[int]]:
        """The ranks of this rank's dp group and of its tp group."""
        return self.mesh["dp"].mesh.tolist(), self.mesh["tp"].mesh.tolist()

    def build_mesh_error(self, tensor_parallel_size: int) -> str:
        try:
            build_mesh(tensor_parallel_size, "cpu")
        except ValueError as exc:
            return str(exc)
        return ""


def _reference_step(model_dir: Path) -> dict[str, Any]:
    """The single-process step: logits, torch's clip_grad_norm_, clipped gradients, updated weights."""
    model = load_model(str(model_dir), "float32")
    ids, mask = _batch()
    logits = model(input_ids=ids, attention_mask=mask).logits
    _loss(logits, ids, mask, float(mask[:, 1:].sum())).backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
    grads = {key: p.grad.clone() for key, p in model.named_parameters()}
    initial = {key: value.clone() for key, value in model.state_dict().items()}
    torch.optim.AdamW(model.parameters(), lr=LR).step()
    state = model.state_dict()
    moved = max(float((state[key] - initial[key]).abs().max()) for key in state)
    return {"logits": logits.detach(), "norm": norm, "grads": grads, "state": state, "moved": moved}


def _assert_step_matches(got: dict[str, Any], state: dict[str, torch.Tensor], ref: dict[str, Any]) -> None:
    assert got["norm"] == pytest.approx(ref["norm"], rel=1e-5)
    assert set(got["grads"]) == set(ref["grads"])
    for key, grad in ref["grads"].items():
        torch.testing.assert_close(got["grads"][key], grad, atol=1e-6, rtol=1e-4, msg=key)
    assert ref["moved"] > 1e-3  # the step moved the weights by far more than the tolerance
    assert set(state) == set(ref["state"])
    for key, value in ref["state"].items():
        torch.testing.assert_close(state[key], value, atol=2e-5, rtol=1e-4, msg=key)


def _run_group(
    model_dir: Path, tensor_parallel_size: int, calls: list[tuple[str, tuple[Any, ...]]], world_size: int = 2
) -> list[list[Any]]:
    """Every rank's result of each ``(method, args)`` call, on a fresh group of ``ParallelProbe``."""
    groups = create_node_placement_groups(
        num_nodes=1, bundles_per_node=world_size, use_gpus=False, timeout_s=30.0
    )
    init = {"model_path": str(model_dir), "tensor_parallel_size": tensor_parallel_size}
    group = RayRankGroup(ParallelProbe, groups, init, timeout_s=TIMEOUT_S)
    try:
        results = [group.run_all(method, *args) for method, args in calls]
    finally:
        group.shutdown()
        remove_placement_groups(groups)
    for (method, _), per_rank in zip(calls, results, strict=True):
        if method == "step":  # the norm is a collective result: identical on every rank
            assert len({r["norm"] for r in per_rank}) == 1
    return results


def _with_and_without_checkpointing(ids: torch.Tensor, mask: torch.Tensor) -> list[tuple[str, tuple]]:
    """Probe calls: build a plain and a checkpointed model, step both, gather both states."""
    return [
        ("build", ("plain", False)),
        ("build", ("checkpointed", True)),
        ("step", ("plain", ids, mask)),
        ("step", ("checkpointed", ids, mask)),
        ("full_state_dict", ("plain",)),
        ("full_state_dict", ("checkpointed",)),
    ]


def test_tensor_parallel_step_equals_single_process(ray_cluster: None, tiny_tp_model_dir: Path) -> None:
    ids, mask = _batch()
    calls = [
        *_with_and_without_checkpointing(ids, mask),
        ("architecture_logit_errors", ()),
        ("parallelize_error", (1,)),
        ("build_mesh_error", (3,)),
    ]
    results = [per_rank[0] for per_rank in _run_group(tiny_tp_model_dir, 2, calls)[2:]]
    plain, checkpointed, plain_state, checkpointed_state, arch_errors, kv_error, mesh_error = results
    ref = _reference_step(tiny_tp_model_dir)
    for got, state in ((plain, plain_state), (checkpointed, checkpointed_state)):
        torch.testing.assert_close(got["logits"], ref["logits"], atol=1e-5, rtol=1e-5)
        _assert_step_matches(got, state, ref)
    assert (plain["calls"], checkpointed["calls"]) == (1, 2)  # the backward recomputed the layer
    assert set(arch_errors) == {name for name, _, _ in ARCHITECTURES}
    assert max(arch_errors.values()) < 1e-5, arch_errors
    message, intact = kv_error
    assert "'llama'" in message and "num_key_value_heads=1" in message and "tensor_parallel_size=2" in message
    assert "values that work: [1]" in message and intact
    assert "tensor_parallel_size=3" in mesh_error and "[1, 2]" in mesh_error


def test_activation_checkpointing_under_fsdp_keeps_the_step(
    ray_cluster: None, tiny_tp_model_dir: Path
) -> None:
    ids, mask = _batch()
    calls = _with_and_without_checkpointing(ids, mask)
    results = [per_rank[0] for per_rank in _run_group(tiny_tp_model_dir, 1, calls)[2:]]
    plain, checkpointed, plain_state, checkpointed_state = results
    assert (plain["calls"], checkpointed["calls"]) == (1, 2)
    for key, grad in plain["grads"].items():
        torch.testing.assert_close(checkpointed["grads"][key], grad, atol=1e-7, rtol=1e-6, msg=key)
    for key, value in plain_state.items():
        torch.testing.assert_close(checkpointed_state[key], value, atol=1e-7, rtol=1e-6, msg=key)
    ref = _reference_step(tiny_tp_model_dir)
    torch.testing.assert_close(plain["logits"], ref["logits"][:2], atol=1e-5, rtol=1e-5)  # rank 0's rows
    _assert_step_matches(plain, plain_state, ref)


def test_two_by_two_mesh_step_equals_single_process(ray_cluster: None, tiny_tp_model_dir: Path) -> None:
    """dp=2 x tp=2: TP'd weights on the 2-D mesh, the rest on the 1-D dp mesh (mixed in clip_grad_norm)."""
    ids, mask = _batch()
    calls = [
        ("mesh_groups", ()),
        ("build", ("checkpointed", True)),
        ("step", ("checkpointed", ids, mask)),
        ("full_state_dict", ("checkpointed",)),
    ]
    meshes, _, steps, states = _run_group(tiny_tp_model_dir, 2, calls, world_size=4)
    assert meshes == [([0, 2], [0, 1]), ([1, 3], [0, 1]), ([0, 2], [2, 3]), ([1, 3], [2, 3])]
    ref = _reference_step(tiny_tp_model_dir)
    for rank in range(4):  # each tp pair computes the logits of its dp rank's two rows
        rows = slice(2 * (rank // 2), 2 * (rank // 2) + 2)
        torch.testing.assert_close(steps[rank]["logits"], ref["logits"][rows], atol=1e-5, rtol=1e-5)
    _assert_step_matches(steps[0], states[0], ref)


def test_check_tensor_parallel_names_model_heads_and_sizes_that_work() -> None:
    config = LlamaConfig(num_attention_heads=4, num_key_value_heads=2, intermediate_size=96, hidden_size=32)
    assert check_tensor_parallel(config, 1) == [] and check_tensor_parallel(config, 2) == []
    (message,) = check_tensor_parallel(config, 4)
    assert message == (
        "model_type 'llama' cannot use tensor_parallel_size=4: num_attention_heads=4 and "
        "num_key_value_heads=2 must both divide by it (tensor_parallel_size values that work: [1, 2])"
    )
    (message,) = check_tensor_parallel(LlamaConfig(intermediate_size=100, num_key_value_heads=8), 8)
    assert "intermediate_size=100" in message and "[1, 2, 4]" in message
    assert "must be >= 1" in check_tensor_parallel(config, 0)[0]
    nested = transformers.Gemma3Config(text_config=_WINDOW)  # heads live in the text config
    assert "'gemma3_text'" in check_tensor_parallel(nested, 8)[0] and check_tensor_parallel(nested, 2) == []


def test_unknown_layout_is_refused_naming_the_class() -> None:
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8))
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel: no decoder layers at model\.layers"):
        validate_tensor_parallel(model, 2)


def test_clip_grad_norm_without_process_group_matches_torch() -> None:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in ((3, 4), (5,), (2,))]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p, twin in zip(params[:2], twins[:2], strict=True):  # the last parameter has no gradient
        p.grad = torch.randn(p.shape, generator=gen)
        twin.grad = p.grad.clone()
    unclipped = [p.grad.clone() for p in params[:2]]
    expected = float(torch.nn.utils.clip_grad_norm_(twins, 0.5))
    assert clip_grad_norm(params, None) == pytest.approx(expected, rel=1e-6)
    assert all(torch.equal(p.grad, g) for p, g in zip(params, unclipped, strict=False))  # None: no clipping
    assert clip_grad_norm(params, 0.5) == pytest.approx(expected, rel=1e-6)
    for p, twin in zip(params[:2], twins[:2], strict=True):
        torch.testing.assert_close(p.grad, twin.grad)
    assert clip_grad_norm(params, 100.0) == pytest.approx(0.5, rel=1e-5)  # below max_norm: unchanged
    for p, twin in zip(params[:2], twins[:2], strict=True):
        torch.testing.assert_close(p.grad, twin.grad)
