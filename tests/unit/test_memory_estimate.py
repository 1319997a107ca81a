"""The memory estimate of `plan`/`validate` (rlfleet.memory.estimate, rlfleet.memory.planner) and the token
budgets resolved from it (``resolve_batching``).

The per-layer activation count is checked exactly against what autograd saves in transformers' Llama; the
whole tensor estimate of a pass against the measured peak of live tensors of a tiny model's logprob and
training passes (within 25%, the bound benchmarks/memory.py reports for SmolLM2's resident memory); the
refusal against a machine made small.
"""

from __future__ import annotations

import typing
import weakref
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import LlamaConfig, LlamaForCausalLM

from rlfleet.algorithms.grpo.describe import describe_grpo
from rlfleet.cli import main
from rlfleet.config import load_recipe, resolve_recipe_path
from rlfleet.config.algorithm import Algorithm
from rlfleet.config.layout import resource_layout
from rlfleet.config.schema import ArchitectureConfig, OptimizerConfig
from rlfleet.memory.estimate import (
    GIB,
    ModelState,
    PassShape,
    layer_activation_bytes,
    logprob_peak,
    output_gradient_bytes,
    train_peak,
)
from rlfleet.memory.planner import (
    OPTIMIZER_STATE_BYTES,
    count_lora_parameters,
    count_parameters,
    largest_fitting_tokens,
    memory_plan,
    memory_problems,
    resolve_batching,
)
from rlfleet.models.loading import ModelSource
from rlfleet.models.tiny import TinyModelSpec, create_tiny_model
from rlfleet.policy.batch import collate
from rlfleet.policy.microbatch import MicroBatching
from rlfleet.policy.rank import PolicyRank
from rlfleet.runtime.components import micro_batching
from tests.conftest import TEST_OPTIMIZER, pg_loss

SHAPES = [  # hidden, intermediate, heads, kv heads
    (128, 256, 4, 4),
    (256, 512, 4, 2),
    (128, 256, 8, 2),
]


def _saved_bytes(h: int, i: int, heads: int, kv: int, layers: int, tokens: int, dtype: str) -> int:
    """Bytes autograd saves for the backward of a Llama forward, weights and their casts excluded."""
    cfg = LlamaConfig(
        hidden_size=h, intermediate_size=i, num_attention_heads=heads, num_key_value_heads=kv,
        num_hidden_layers=layers, vocab_size=64, tie_word_embeddings=True,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    weight_sizes = {p.numel() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage().data_ptr()
        if key not in weights and t.numel() not in weight_sizes:  # not a weight, nor its cast
            saved[key] = t.untyped_storage().nbytes()
        return t

    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
        model.model(input_ids=torch.randint(0, 64, (1, tokens)))
    return sum(saved.values())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("h", "i", "heads", "kv"), SHAPES)
def test_layer_activation_bytes_is_what_autograd_saves(
    dtype: str, h: int, i: int, heads: int, kv: int
) -> None:
    tokens = 47  # prime: no activation has a weight's number of elements
    per_layer = (
        _saved_bytes(h, i, heads, kv, 3, tokens, dtype) - _saved_bytes(h, i, heads, kv, 2, tokens, dtype)
    ) / tokens
    arch = ArchitectureConfig(
        hidden_size=h, num_hidden_layers=3, num_attention_heads=heads, num_key_value_heads=kv,
        intermediate_size=i, vocab_size=64, tie_word_embeddings=True,
    )  # fmt: skip
    assert layer_activation_bytes(arch, 4 if dtype == "float32" else 2) == per_layer


# ------------------------------------------------------------------ the estimate against a measured pass


class LiveTensorBytes(TorchDispatchMode):  # type: ignore[misc]
    """Counts the bytes of CPU tensor storages created under it that are still alive; ``peak`` is the
    most at once. Storages an op was given (in-place results, views) are not new and are not counted
    (every op goes through Python: slow on large models)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: set[int] = set()

    def _free(self, key: int, size: int) -> None:
        self._seen.discard(key)
        self.live -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        given = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor)
        }
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key and key not in self._seen and key not in given:
                size = storage.nbytes()
                self._seen.add(key)
                self.live += size
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._free, key, size)
        return out


SPECS = {  # the peak of a logprob pass in the MLP, and in the attention (its rotary temporaries)
    "mlp": TinyModelSpec(num_hidden_layers=2, vocab_size=512),  # hidden 128, intermediate 384, 4/2 heads
    "attention": TinyModelSpec(
        num_hidden_layers=2,
        vocab_size=512,
        hidden_size=256,
        intermediate_size=128,
        num_attention_heads=8,
        num_key_value_heads=8,
    ),
}


@pytest.fixture(scope="module", params=list(SPECS))
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    corpus = [f"{a} plus {b} is {a + b}" for a in range(60) for b in range(20)]
    return create_tiny_model(tmp_path_factory.mktemp("mem") / "model", corpus, SPECS[request.param], seed=0)


def _arch(c: LlamaConfig) -> ArchitectureConfig:
    return ArchitectureConfig(
        hidden_size=c.hidden_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
        intermediate_size=c.intermediate_size, vocab_size=c.vocab_size, tie_word_embeddings=True,
    )  # fmt: skip


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
@pytest.mark.parametrize(("checkpointing", "chunk"), [(False, None), (True, None), (False, 128), (True, 128)])
def test_estimate_holds_the_measured_peak_of_live_tensors(
    model_dir: Path, precision: str, checkpointing: bool, chunk: int | None
) -> None:
    """The estimate's tensor part (what a pass allocates above the weights and AdamW moments) is within
    15% of the peak of live tensors the pass created, for both passes (measured: logprob passes within
    2%, training passes 0.86-1.11x)."""
    worker = PolicyRank(
        ModelSource(str(model_dir), precision), TEST_OPTIMIZER, keep_reference=False,
        activation_checkpointing=checkpointing,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    rows, tokens = 16, 16 * 128
    arch = _arch(worker.model.config)
    prompts = [torch.randint(3, arch.vocab_size, (48,), generator=gen).tolist() for _ in range(rows)]
    responses = [torch.randint(3, arch.vocab_size, (80,), generator=gen).tolist() for _ in range(rows)]
    batch = collate(prompts, responses, 0).with_(advantages=torch.randn(rows, generator=gen))
    batching = MicroBatching(rows, tokens, pack=True, logprob_chunk=chunk)
    batch = batch.with_(prev_logprobs=worker.logprobs(batch, batching))

    def train() -> None:
        worker.train(batch, pg_loss(), global_batch_size=rows, micro_batching=batching)

    train()  # the AdamW moments exist from here on
    measured = {}
    for name, run in (("train", train), ("logprob", lambda: worker.logprobs(batch, batching))):
        with LiveTensorBytes() as live:
            run()
        measured[name] = live.peak

    n = count_parameters(arch)
    compute = 4 if precision == "float32" else 2
    state = ModelState(
        weights=4 * n, optimizer=8 * n, gradients=4 * n, reference=0.0, compute_copies=(compute == 2) * 2 * n
    )
    shape = PassShape(
        tokens=tokens, logit_tokens=chunk or tokens, compute_bytes=compute, checkpointing=checkpointing
    )
    held = {"weights (fp32)", "AdamW moments (fp32)"}  # allocated before the pass
    for name, parts in (
        ("train", train_peak(arch, state, shape, cpu=False)),
        ("logprob", logprob_peak(arch, state, shape, cpu=False)),
    ):
        estimated = sum(v for k, v in parts.items() if k not in held)
        if "logits" in parts and name == "logprob":  # logsumexp's float32 temporary: internal to the kernel
            estimated -= 4 * shape.logit_tokens * arch.vocab_size
        assert estimated == pytest.approx(measured[name], rel=0.15), (name, parts, measured[name])


# ----------------------------------------------------------------------------------- plan and refusal

OOM_LAYOUT = [  # issue 20: OOM-killed at 21 GB resident on a 24 GB machine
    "policy.sequence_packing.enabled=true",
    "policy.train_micro_batch_size=16",
    "policy.logprob_batch_size=32",
    "policy.precision=bfloat16",
    "policy.dtensor_cfg.activation_checkpointing=false",  # as the recipe had then (now on)
    "policy.logprob_chunk_size=null",
    # the budgets it had then (rows x sequence budget); unset, they are now sized to the machine
    "policy.sequence_packing.train_mb_tokens=10240",
    "policy.sequence_packing.logprob_mb_tokens=20480",
]


def _cfg(*overrides: str):
    return load_recipe(resolve_recipe_path("grpo-smollm2-135m-gsm8k-cpu"), list(overrides))


def _machine(monkeypatch: pytest.MonkeyPatch, gib: float) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("RLFLEET_MEMORY_CHECK", raising=False)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setattr("rlfleet.memory.planner.cpu_available_bytes", lambda: int(gib * GIB))
    monkeypatch.setattr("rlfleet.memory.planner.running_allocator", lambda: "glibc")


def test_the_layout_the_oom_killer_ended_is_refused_with_the_estimate_and_a_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _machine(monkeypatch, 22.8)  # this machine's MemAvailable
    cfg = _cfg(*OOM_LAYOUT)
    [problem] = memory_problems(cfg)
    assert "exceeds 90% of the 22.8 GiB available" in problem and "train pass of 10,240 tokens" in problem
    assert "activation_checkpointing=true" in problem and "logprob_chunk_size=512" in problem
    assert "policy.sequence_packing.train_mb_tokens=" in problem
    monkeypatch.setenv("RLFLEET_MEMORY_CHECK", "off")
    assert memory_problems(cfg) == []


def test_a_refusal_on_a_cpu_machine_says_there_is_no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    _machine(monkeypatch, 22.8)
    [problem] = memory_problems(_cfg(*OOM_LAYOUT))
    assert "available on this machine (no CUDA GPU is visible: it would train on the CPU)" in problem


def test_the_suggested_fixes_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    _machine(monkeypatch, 22.8)
    assert (
        memory_problems(
            _cfg(
                *OOM_LAYOUT,
                "policy.dtensor_cfg.activation_checkpointing=true",
                "policy.logprob_chunk_size=512",
            )
        )
        == []
    )
    cfg = _cfg(*OOM_LAYOUT)
    layout, n = resource_layout(cfg), count_parameters(cfg.policy.architecture)
    best = largest_fitting_tokens(cfg, layout, n, n, "train")
    assert best is not None and best % 256 == 0
    available = 22.8 * GIB

    def train_total(tokens: int) -> float:
        plan = memory_plan(cfg, layout, n, n, tokens={"train": tokens, "logprob": 256})
        return sum(plan.passes["train"].values()) + sum(plan.generation.values())

    assert train_total(best) <= 0.7 * available < train_total(best + 256)
    fixed = _cfg(
        *OOM_LAYOUT,
        f"policy.sequence_packing.train_mb_tokens={best}",
        f"policy.sequence_packing.logprob_mb_tokens={largest_fitting_tokens(cfg, layout, n, n, 'logprob')}",
    )
    assert memory_problems(fixed) == []


def _fitted(cfg) -> dict[str, int]:
    return {pass_: budget.tokens for pass_, budget in resolve_batching(cfg).fitted().items()}


def test_an_unset_budget_is_the_largest_that_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Packing (or dynamic batching) without a token budget: the largest that fits with 30% headroom,
    at most a rank's whole share of the batch, instead of rows x sequence budget; so the layout the OOM
    killer ended now runs within its estimate. A budget set, the check off, or a run elsewhere: the
    recipe's own default."""
    _machine(monkeypatch, 22.8)
    unset = OOM_LAYOUT[:-2]
    cfg = _cfg(*unset)
    layout, n = resource_layout(cfg), count_parameters(cfg.policy.architecture)
    train = largest_fitting_tokens(cfg, layout, n, n, "train")
    assert train is not None and 640 <= train < 10240
    batching = resolve_batching(cfg, layout)
    assert batching.section == "sequence_packing"
    # each budget says why it is what it is: capped by memory, or by the rows there are to fit
    assert {k: (b.tokens, b.why) for k, b in batching.fitted().items()} == {
        "train": (train, "the largest that fits this machine's memory with headroom"),
        "logprob": (10240, "a rank's whole share of the batch, which fits this machine's memory"),
    }  # 16 rows x 640: all of them fit
    described = dict(describe_grpo(cfg, batching))["micro-batches"]
    assert f"up to {train:,} tokens per training pass and 10,240 per logprob pass" in described
    assert "(train_mb_tokens: the largest that fits" in described
    assert "logprob_mb_tokens: a rank's whole share of the batch" in described
    # the builder reads the resolved budget (and logs it), it does not resolve one of its own
    monkeypatch.setattr("rlfleet.memory.planner.cpu_available_bytes", lambda: pytest.fail("resolved again"))
    assert micro_batching(cfg, "train", batching).tokens == train
    assert micro_batching(cfg, "logprob", batching).tokens == 10240
    _machine(monkeypatch, 22.8)
    assert memory_problems(cfg, layout, "grpo", batching) == []
    assert memory_plan(cfg, layout, n, n).tokens == {"train": train, "logprob": 10240}
    assert _fitted(_cfg(*unset, "policy.sequence_packing.train_mb_tokens=2048")) == {"logprob": 10240}
    assert resolve_batching(cfg, layout, "sft").budgets.keys() == {"train"}  # SFT has no logprob pass
    assert memory_problems(cfg, layout, "sft") == []  # nor is one fitted for it
    monkeypatch.setenv("RLFLEET_MEMORY_CHECK", "off")
    recipe = resolve_batching(cfg)
    assert recipe.fitted() == {} and micro_batching(cfg, "train", recipe).tokens == 16 * 640
    assert recipe.budget("train").why == "max_total_sequence_length x train_micro_batch_size"
    monkeypatch.delenv("RLFLEET_MEMORY_CHECK")
    assert _fitted(_cfg(*unset, "cluster.num_nodes=2")) == {}
    _machine(monkeypatch, 4.0)  # not one sequence fits: the recipe's default, and the refusal
    assert _fitted(cfg) == {} and memory_problems(cfg)


def test_the_fitted_budget_is_logged_once_per_pass(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _machine(monkeypatch, 22.8)
    cfg = _cfg(*OOM_LAYOUT[:-2])
    batching = resolve_batching(cfg)
    with caplog.at_level("INFO", logger="rlfleet"):
        micro_batching(cfg, "train", batching)
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith("policy.sequence_packing.train_mb_tokens=") and "the largest that fits" in line


def test_every_optimizer_the_schema_admits_has_its_state_size() -> None:
    admitted = typing.get_args(OptimizerConfig.model_fields["name"].annotation)
    assert set(admitted) == set(OPTIMIZER_STATE_BYTES)


def test_jemalloc_keeps_no_heap_retention(monkeypatch: pytest.MonkeyPatch) -> None:
    """What glibc's heap keeps of a backward is a glibc term: jemalloc, as rlfleet runs a training process,
    reuses it (benchmarks/memory.py measures both)."""
    _machine(monkeypatch, 22.8)
    cfg = _cfg(*OOM_LAYOUT)
    layout, n = resource_layout(cfg), count_parameters(cfg.policy.architecture)
    glibc = memory_plan(cfg, layout, n, n, allocator="glibc").passes["train"]
    jemalloc = memory_plan(cfg, layout, n, n, allocator="jemalloc").passes["train"]
    assert glibc["heap retention"] > 1 * GIB and "heap retention" not in jemalloc
    assert {k: v for k, v in glibc.items() if k != "heap retention"} == jemalloc


def test_nothing_is_compared_where_the_run_does_not_train_here(monkeypatch: pytest.MonkeyPatch) -> None:
    _machine(monkeypatch, 1.0)
    assert memory_problems(_cfg(*OOM_LAYOUT))  # 1 GiB: refused here
    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")
    assert memory_problems(_cfg(*OOM_LAYOUT)) == []
    monkeypatch.delenv("RAY_ADDRESS")
    assert memory_problems(_cfg(*OOM_LAYOUT, "cluster.num_nodes=2")) == []
    assert memory_problems(_cfg(*OOM_LAYOUT, "policy.architecture=null")) == []


def test_validate_exits_2_before_loading_anything(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _machine(monkeypatch, 22.8)
    monkeypatch.setattr(
        "rlfleet.models.loading.ModelSource.load_tokenizer", lambda self: pytest.fail("loaded")
    )
    assert main(["validate", "grpo-smollm2-135m-gsm8k-cpu", *OOM_LAYOUT]) == 2
    err = capsys.readouterr().err
    assert "would not fit in memory" in err and "fix:" in err


def test_plan_prints_each_pass_the_machine_and_what_it_runs_on(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _machine(monkeypatch, 22.8)
    assert main(["plan", "grpo-smollm2-135m-arithmetic-cpu", "policy.generation.backend=hf"]) == 0
    out = capsys.readouterr().out
    assert "CPU worker process(es)" in out and "GPU" not in out.split("model")[0]
    assert "train pass peak" in out and "logprob pass peak" in out and "activations" in out
    assert "fits: estimate" in out and "of 22.8 GiB available on this machine" in out
    assert "largest budget      policy.sequence_packing.train_mb_tokens=" in out


def test_the_output_layers_gradient_counts_from_the_start_of_the_backward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Gemma 3 270M's tied 262,144 x 640 output layer is 168M of its 268M parameters: its float32 gradient
    (0.62 GiB) is held beside the logits and the activations from the start of the backward (measured:
    benchmarks/memory.py --recipe sft-gemma3-270m-gsm8k-cpu peaks at 7.8 GiB, where the estimate without
    it said 6.2). LoRA freezes the output layer: no such gradient."""
    _machine(monkeypatch, 64)
    full = load_recipe(resolve_recipe_path("sft-gemma3-270m-gsm8k-cpu"), [])
    arch = full.policy.architecture
    assert arch is not None and arch.tie_word_embeddings
    n = count_parameters(arch)
    parts = memory_plan(full, resource_layout(full), n, n, algorithm="sft").passes["train"]
    assert parts["output-layer gradient"] == output_gradient_bytes(arch) == 4 * 262_144 * 640
    lora = load_recipe(
        resolve_recipe_path("sft-gemma3-270m-gsm8k-cpu"), ["policy.dtensor_cfg.lora_cfg.enabled=true"]
    )
    trainable = count_lora_parameters(lora)
    parts = memory_plan(lora, resource_layout(lora), n, trainable, algorithm="sft").passes["train"]
    assert "output-layer gradient" not in parts


# Anonymous resident memory of a CPU vLLM engine's processes (bf16, VLLM_CPU_KVCACHE_SPACE=1, 64 samples of
# 256 tokens with their logprobs; /proc/<pid>/status of each after two generate calls), against the estimate.
MEASURED_VLLM_ENGINES = [
    # recipe, worker process (weights, KV cache space and the rest), engine core process
    ("grpo-smollm2-135m-gsm8k-cpu", 2.17, 0.45),
    ("grpo-gemma3-270m-gsm8k-cpu", 2.98, 0.73),
]


@pytest.mark.parametrize(("recipe", "worker", "core"), MEASURED_VLLM_ENGINES)
def test_the_vllm_engine_estimate_holds_its_measured_processes(
    monkeypatch: pytest.MonkeyPatch, recipe: str, worker: float, core: float
) -> None:
    """The plan once counted 1 GiB beside an engine's weights and KV cache; Gemma 3's engine took 2.3 GiB more
    than that (its worker keeps a oneDNN-packed copy of each linear weight, its engine core a 262k-entry
    tokenizer)."""
    _machine(monkeypatch, 64)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    # measured in bf16: pinned, since `precision: auto` is float32 on a CPU without native bf16 (AVX2)
    overrides = ["policy.generation.backend=vllm", "policy.precision=bfloat16"]
    cfg = load_recipe(resolve_recipe_path(recipe), overrides)
    layout, n = resource_layout(cfg), count_parameters(cfg.policy.architecture)
    parts = memory_plan(cfg, layout, n, n, tokens={"train": 4096, "logprob": 4096}).generation
    in_worker = (
        sum(v for k, v in parts.items() if k.startswith(("vLLM weights", "vLLM KV", "vLLM worker"))) / GIB
    )
    in_core = sum(v for k, v in parts.items() if "core" in k) / GIB
    assert 0.95 < in_worker / worker < 1.1, (in_worker, worker)
    assert 0.95 < in_core / core < 1.1, (in_core, core)
    assert any("client" in k for k in parts)  # the trainer imports vLLM for its client


def test_the_environment_workers_are_counted_beside_the_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GRPO run of Gemma 3: the math environment's forkserver and two workers held 0.19 GiB each (0.57)."""
    _machine(monkeypatch, 64)

    def environment_part(workers: int, algorithm: Algorithm = "grpo") -> dict[str, float]:
        cfg = load_recipe(
            resolve_recipe_path("grpo-gemma3-270m-gsm8k-cpu"), [f"env.math.num_workers={workers}"]
        )
        layout, n = resource_layout(cfg), count_parameters(cfg.policy.architecture)
        tokens = {"train": 4096, "logprob": 4096}
        parts = memory_plan(cfg, layout, n, n, tokens=tokens, algorithm=algorithm).generation
        return {k: v for k, v in parts.items() if "environment workers" in k}

    [(name, size)] = environment_part(2).items()
    assert name == "math environment workers (2 + forkserver)" and abs(size / GIB - 0.57) < 0.01
    assert list(environment_part(4).values()) == [5 * int(0.19 * GIB)]
    assert environment_part(2, "rm") == {}  # a reward model's run scores nothing
