"""The ``reward_model`` environment: a sequence-classification model scores each conversation.

NeMo RL's ``RewardModelEnvironment`` (``nemo_rl/environments/reward_model_environment.py``), with its
semantics and key names: single turn (every episode ends on its first step), the reward is the model's raw
score (a Bradley-Terry reward model's logit, unnormalised; GRPO's per-group normalisation makes its offset
immaterial to the advantages), and the metrics ``reward_model_env/{num_samples,mean_reward,std_reward,
min_reward,max_reward}`` of the step's returns, logged as ``train/env/<name>/reward_model_env/mean_reward``
(``val/...`` in validation).

How it departs from NeMo RL:

* In a one-process run it scores in the trainer process, on its GPU when it has one; on a Ray run, in a Ray
  actor of its own with ``resources.gpus_per_node`` GPUs, as NeMo RL gives the reward model its own worker.
  Its settings, config and tokenizer are checked before anything expensive starts (``preflight``); the
  weights load once, where it scores.
* Each conversation is rendered with the reward model's own chat template and tokenised with its own
  tokenizer: its vocabulary need not be the policy's.
* A conversation longer than ``max_model_len`` tokens keeps its last ``max_model_len`` (the reply's end,
  where the score is read) and is counted in ``reward_model_env/truncated``.
* Batches are right-padded: the score is read at each row's last token that is not the padding id (the
  rule of transformers' sequence-classification heads), so a padded row scores as it does alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from rlfleet.config.env_models import RewardModelEnvConfig, named_model_settings
from rlfleet.environments.interface import EnvironmentInterface, EnvironmentReturn, MessageLog
from rlfleet.models.chat import encode_conversation, end_at_eos

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "METRIC_PREFIX",
    "RewardModelEnvironment",
    "RewardModelScorer",
    "check_one_label",
    "keep_last",
    "load_reward_model",
    "reward_metrics",
    "reward_model_tokenizer",
    "right_padded",
]

METRIC_PREFIX = "reward_model_env"
TRUNCATED = "reward_model_truncated"  # the metadata flag of an episode whose conversation was cut


def keep_last(ids: Sequence[int], max_len: int) -> tuple[list[int], bool]:
    """The last ``max_len`` ids and whether any were dropped (the score is read at the end)."""
    return (list(ids[-max_len:]), True) if len(ids) > max_len else (list(ids), False)


def right_padded(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, T]`` input ids right-padded with ``pad_id`` and their ``[B, T]`` attention mask."""
    width = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros_like(input_ids)
    for i, row in enumerate(rows):
        input_ids[i, : len(row)] = torch.tensor(list(row), dtype=torch.long)
        attention[i, : len(row)] = 1
    return input_ids, attention


def check_one_label(model_name: str, num_labels: int | None) -> None:
    """Raises ValueError unless the model's head has one label (the scalar score)."""
    if num_labels != 1:
        raise ValueError(
            f"reward model {model_name!r} has num_labels={num_labels}, but the reward_model environment "
            "reads one scalar score per conversation; fix: a reward model whose config has num_labels=1 (a "
            "Bradley-Terry sequence classifier), or a user's environment for a multi-label classifier"
        )


def scoring_device() -> torch.device:
    """The trainer's GPU when it has one, else the CPU."""
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


def scoring_precision(precision: str, device: torch.device) -> str:
    """The dtype name ``precision`` means on ``device``; ``auto``: bfloat16 on a GPU that computes it, else
    float32 (a scoring model's forward passes only: no master copy to keep)."""
    if precision != "auto":
        return precision
    return "bfloat16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "float32"


@dataclass
class RewardModelScorer:
    """A loaded reward model: conversations in, one score each.

    Attributes:
        model: A sequence-classification model with one label, in eval mode, on its device.
        tokenizer: The reward model's tokenizer, with a chat template.
        batch_size: Conversations per forward pass (batched longest first, so each pads little).
        max_len: Most tokens scored per conversation.
    """

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    batch_size: int
    max_len: int

    def ids(self, log: MessageLog) -> list[int]:
        """The conversation rendered with the reward model's chat template, tokenised, ending at the reply's
        EOS: where ``rlfleet rm`` trained the score (a template's trailing newline after it is cut)."""
        messages = [{"role": m["role"], "content": m.get("content", "")} for m in log]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False)
        assert isinstance(text, str)  # one conversation renders to one string
        return end_at_eos(self.tokenizer, encode_conversation(self.tokenizer, text))

    @torch.inference_mode()
    def score(self, logs: Sequence[MessageLog]) -> tuple[list[float], list[bool]]:
        """Each conversation's score, and whether it was cut to its last ``max_len`` tokens."""
        from rlfleet.generation.hf import length_sorted_batches  # imports transformers' generation code

        if not logs:
            return [], []
        rows, truncated = zip(*(keep_last(self.ids(log), self.max_len) for log in logs), strict=True)
        pad_id = self.model.config.pad_token_id
        scores = [0.0] * len(rows)
        for batch in length_sorted_batches(rows, self.batch_size):
            input_ids, attention = right_padded([rows[i] for i in batch], pad_id)
            out = self.model(
                input_ids=input_ids.to(self.model.device), attention_mask=attention.to(self.model.device)
            )
            for i, value in zip(batch, out.logits[:, 0].float().tolist(), strict=True):  # logits: [B, 1]
                scores[i] = value
        return scores, list(truncated)


def reward_model_tokenizer(settings: RewardModelEnvConfig) -> PreTrainedTokenizerBase:
    """The checks of :func:`load_reward_model` that load no weights: the model's config has one label, and
    its tokenizer (``settings.tokenizer.name`` when set) a chat template. Returns the tokenizer.

    Raises:
        ValueError: The model has ``num_labels != 1``, or its tokenizer has no chat template.
        ModelLoadError: The model's config or tokenizer cannot be found.
    """
    from rlfleet.models.loading import load_config, load_tokenizer

    name = settings.model_name
    check_one_label(name, load_config(name).num_labels)
    tokenizer = load_tokenizer(settings.tokenizer.name or name)
    if not tokenizer.chat_template:
        raise ValueError(
            f"the reward model's tokenizer {settings.tokenizer.name or name!r} has no chat template, so a "
            "conversation cannot be rendered as the model was trained to read it; fix: "
            "env.reward_model.tokenizer.name=<a tokenizer with the reward model's chat template>"
        )
    return tokenizer


def load_reward_model(settings: RewardModelEnvConfig) -> RewardModelScorer:
    """Loads ``settings.model_name`` (its config first, so a head of several labels fails before the weights
    load) and its tokenizer (``settings.tokenizer.name`` when set).

    Raises:
        ValueError: The model has ``num_labels != 1``, or its tokenizer has no chat template.
        ModelLoadError: The model or tokenizer cannot be found.
    """
    # transformers' model code is imported here, not with the package: environment workers stay light
    from transformers import AutoModelForSequenceClassification

    from rlfleet.models.loading import DTYPES, resolve_model_path

    tokenizer = reward_model_tokenizer(settings)
    device = scoring_device()
    model = AutoModelForSequenceClassification.from_pretrained(
        resolve_model_path(settings.model_name), dtype=DTYPES[scoring_precision(settings.precision, device)]
    )
    if model.config.pad_token_id is None:  # the head reads each row at its last non-padding token
        model.config.pad_token_id = tokenizer.pad_token_id
    model.to(device).eval()
    return RewardModelScorer(model, tokenizer, settings.batch_size, settings.max_model_len)


def reward_metrics(rewards: Sequence[float], truncated: int) -> dict[str, float]:
    """NeMo RL's ``reward_model_env/*`` statistics of the returns (std unbiased; 0 for fewer than two) and
    the count of truncated conversations."""
    metrics = {
        f"{METRIC_PREFIX}/num_samples": float(len(rewards)),
        f"{METRIC_PREFIX}/truncated": float(truncated),
    }
    if not rewards:
        return metrics
    values = torch.tensor(list(rewards), dtype=torch.float64)
    return {
        **metrics,
        f"{METRIC_PREFIX}/mean_reward": float(values.mean()),
        f"{METRIC_PREFIX}/std_reward": float(values.std()) if len(values) > 1 else 0.0,
        f"{METRIC_PREFIX}/min_reward": float(values.min()),
        f"{METRIC_PREFIX}/max_reward": float(values.max()),
    }


class RewardModelEnvironment(EnvironmentInterface[dict[str, Any]]):
    """Single turn: the reward is the reward model's score of the whole conversation.

    cfg: the keys of :class:`~rlfleet.config.env_models.RewardModelEnvConfig` (``env.reward_model``).
    """

    def __init__(self, cfg: Mapping[str, Any] | None = None) -> None:
        super().__init__(cfg)
        self.scorer = load_reward_model(self._checked(self.cfg))

    @classmethod
    def preflight(cls, cfg: Mapping[str, Any]) -> None:
        """The constructor's checks without loading the weights (the config's label count, the tokenizer's
        chat template)."""
        reward_model_tokenizer(cls._checked(cfg))

    @staticmethod
    def _checked(cfg: Mapping[str, Any]) -> RewardModelEnvConfig:
        return named_model_settings(
            RewardModelEnvConfig,
            cfg,
            "reward_model",
            "the hub id or local directory of a reward model (AutoModelForSequenceClassification with "
            "num_labels=1)",
        )

    def step(
        self, message_log_batch: list[MessageLog], metadata: list[dict[str, Any]]
    ) -> EnvironmentReturn[dict[str, Any]]:
        scores, truncated = self.scorer.score(message_log_batch)
        n = len(scores)
        return EnvironmentReturn(
            observations=[{"role": "environment", "content": f"Environment: {s:.4g}"} for s in scores],
            metadata=[
                {**(meta or {}), TRUNCATED: cut} for meta, cut in zip(metadata, truncated, strict=True)
            ],
            next_stop_strings=[None] * n,
            rewards=torch.tensor(scores, dtype=torch.float32),
            terminateds=[True] * n,
            answers=[log[-1].get("content", "") if log else None for log in message_log_batch],
        )

    def global_post_process_and_metrics(
        self, batch: Mapping[str, Any]
    ) -> tuple[Mapping[str, Any], dict[str, float]]:
        truncated = sum(isinstance(m, Mapping) and m.get(TRUNCATED) is True for m in batch["metadata"])
        return batch, reward_metrics([float(r) for r in batch["rewards"]], truncated)
