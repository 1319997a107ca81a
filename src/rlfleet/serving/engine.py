"""The endpoint's logic, below HTTP: requests become engine calls, batched, and agent episodes are recorded.

:class:`BatchingQueue` is the only caller of the generation backend: concurrent requests (many agents at once)
wait a few milliseconds to be sampled in one ``generate_rows`` call per sampling setting, each row from its
own seed (rlfleet's sampling is batch-invariant, so batching never changes a sample).

:class:`PolicyEndpoint` serves two kinds of request:

* **plain** (``/v1/...``, ``rlfleet serve``): the request's own sampling settings (``temperature`` 0 is
  greedy, ``seed`` optional, ``n`` choices), bounded by the model's sequence budget;
* **episode** (``/episodes/<key>/v1/...``, the URL an agent of the ``agent`` environment is given): the
  recipe's sampling settings whatever the request says (the trainer's importance weights assume the
  distribution it configured), one choice, one request at a time, each turn recorded token for token
  (:mod:`rlfleet.serving.record`). A closed episode (its agent finished or ran out of time) accepts nothing.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import secrets
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any

from transformers import PreTrainedTokenizerBase

from rlfleet.data.prompts import ObservationTemplate
from rlfleet.environments.tools import TOOL_CALL_CLOSE
from rlfleet.generation import GenerationBackend, GenerationResult, SamplingParams
from rlfleet.generation.sampling import row_seeds, turn_seed
from rlfleet.models.chat import encode_conversation
from rlfleet.serving.chat import (
    ChatMessage,
    message_json,
    read_messages,
    read_tools,
    reply_message,
    tool_schemas,
)
from rlfleet.serving.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    response,
    token_logprobs,
)
from rlfleet.serving.record import EpisodeRecord, Turn

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Job:
    prompt: list[int]
    params: SamplingParams
    seed: int
    future: Future[GenerationResult]


class BatchingQueue:
    """One thread samples every request; requests that arrive together share a ``generate_rows`` call.

    A call waits for more requests while they keep coming (``gather_s`` apart). With ``expected`` (how many
    requests can still come: a run's agents still playing), it waits until that many are queued or
    ``max_wait_s`` has passed since the first: agents that answer a tool result at slightly different times
    then share one call instead of each making a small one.
    """

    def __init__(
        self,
        backend: GenerationBackend,
        max_batch: int = 256,
        gather_s: float = 0.005,
        expected: Callable[[], int] | None = None,
        max_wait_s: float = 0.05,
    ) -> None:
        self.backend, self.max_batch, self.gather_s = backend, max_batch, gather_s
        self.expected, self.max_wait_s = expected, max_wait_s
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self.calls = 0
        self._thread = threading.Thread(target=self._loop, name="rlfleet-serving", daemon=True)
        self._thread.start()

    def submit(self, prompt: Sequence[int], params: SamplingParams, seed: int) -> Future[GenerationResult]:
        future: Future[GenerationResult] = Future()
        self._jobs.put(_Job(list(prompt), params, seed, future))
        return future

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=60)

    def _loop(self) -> None:
        while True:
            first = self._jobs.get()
            if first is None:
                return
            batch, deadline = [first], time.monotonic() + self.max_wait_s
            while len(batch) < self.max_batch:
                if self.expected is None:
                    timeout = self.gather_s
                else:
                    timeout = deadline - time.monotonic()
                    if len(batch) >= self.expected() or timeout <= 0:
                        break
                try:
                    job = self._jobs.get(timeout=timeout)
                except queue.Empty:
                    break
                if job is None:
                    self._jobs.put(None)
                    break
                batch.append(job)
            self._run(batch)

    def _run(self, batch: list[_Job]) -> None:
        by_params: dict[SamplingParams, list[_Job]] = defaultdict(list)
        for job in batch:
            by_params[job.params].append(job)
        for params, jobs in by_params.items():
            try:
                results = self.backend.generate_rows([j.prompt for j in jobs], params, [j.seed for j in jobs])
                self.calls += 1
            except Exception as exc:  # every request of the call fails; the server goes on
                log.exception("generation failed for %d request(s)", len(jobs))
                for job in jobs:
                    job.future.set_exception(exc)
            else:
                for job, result in zip(jobs, results, strict=True):
                    job.future.set_result(result)


@dataclass(frozen=True)
class ServingLimits:
    """Bounds on what a request may ask: the sequence budget, and a reply's length."""

    max_seq_len: int
    max_new_tokens: int
    max_requests_per_episode: int = 64


@dataclass
class _Episode:
    record: EpisodeRecord
    params: SamplingParams
    busy: bool = False


class PolicyEndpoint:
    """Renders, samples and records requests for one served model (see the module docstring)."""

    def __init__(
        self,
        backend: GenerationBackend,
        tokenizer: PreTrainedTokenizerBase,
        model_name: str,
        limits: ServingLimits,
        episodes_only: bool = False,
    ) -> None:
        self.tokenizer, self.model_name, self.limits = tokenizer, model_name, limits
        self.episodes_only = episodes_only
        self.template = ObservationTemplate(tokenizer)
        # agent episodes: a call waits (briefly) for every playing agent's request
        self.queue = BatchingQueue(backend, expected=self.open_episodes if episodes_only else None)
        self._episodes: dict[str, _Episode] = {}
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # an episode's request ended

    def close(self) -> None:
        self.queue.close()

    # ------------------------------------------------------------------------------------------- episodes

    def open_episodes(self) -> int:
        """How many episodes are open (their agents still playing)."""
        return len(self._episodes)

    def open_episode(self, seed: int, params: SamplingParams) -> str:
        key = secrets.token_urlsafe(12)
        with self._lock:
            self._episodes[key] = _Episode(EpisodeRecord(seed), params)
        return key

    def close_episodes(self, keys: Sequence[str]) -> list[EpisodeRecord]:
        """Closes the episodes (their URLs refuse further requests) once every request already accepted for
        them has been sampled and recorded; returns their records."""
        with self._changed:
            episodes = [self._episodes.pop(key) for key in keys]
            self._changed.wait_for(lambda: not any(e.busy for e in episodes))
        return [e.record for e in episodes]

    def _release(self, episode: _Episode) -> None:
        with self._changed:
            episode.busy = False
            self._changed.notify_all()

    # ------------------------------------------------------------------------------------------- requests

    def check_plain(self) -> None:
        if self.episodes_only:
            raise APIError(
                400,
                "this server samples for a training run's agent episodes only; use the episode URL the "
                "agent was given (rlfleet serve serves plain requests)",
                code="episodes_only",
            )

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(
                404,
                f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                code="model_not_found",
                param="model",
            )

    async def chat(self, request: ChatCompletionRequest, episode: str | None) -> dict[str, Any]:
        request.refuse_unsupported()
        self.check_model(request.model)
        messages, tools = read_messages(request.messages), read_tools(request.tools)
        if request.tool_choice == "none":
            tools = ()
        tools_key = repr([t.schema() for t in tools])
        stops = request.stop_strings() + ((TOOL_CALL_CLOSE,) if tools else ())
        if episode is None:
            self.check_plain()
            prompt = self._render(messages, tools)
            return await self._plain_chat(request, prompt, tools, stops)
        with self._lock:
            current = self._claim(episode, request.n)
            record = current.record
            new = record.extends(messages, tools_key)
        try:
            if new is not None:
                last = record.current.token_ids if record.current is not None else []
                ended_with_eos = bool(last) and last[-1] == self.tokenizer.eos_token_id
                observation = self.template.ids_of([m.for_template() for m in new], ended_with_eos)
                assert record.current is not None
                turn = Turn([*record.current.context(), *observation], observation, messages, tools_key)
            else:
                turn = Turn(self._render(messages, tools), None, messages, tools_key)
            result = await self._sample_turn(current, turn, request.token_limit(), stops)
            reply = reply_message(_strip_stops(result.text, request.stop_strings()), tools)
            record.commit(turn, result.token_ids, result.logprobs, result.finished, reply)
        finally:
            self._release(current)
        choice = self._chat_choice(0, result, reply, request.logprobs)
        return response("chat", self.model_name, turn.prompt_ids, [choice], len(result.token_ids))

    async def complete(self, request: CompletionRequest, episode: str | None) -> dict[str, Any]:
        request.refuse_unsupported()
        self.check_model(request.model)
        prompt = self._prompt_ids(request.prompt)
        stops = request.stop_strings()
        if episode is None:
            self.check_plain()
            params, seeds = self._plain_params(request, len(prompt), stops)
            results = await self._sample([prompt] * len(seeds), params, seeds)
            choices = [self._completion_choice(i, r, stops, request.logprobs) for i, r in enumerate(results)]
            tokens = sum(len(r.token_ids) for r in results)
            return response("completion", self.model_name, prompt, choices, tokens)
        with self._lock:
            current = self._claim(episode, request.n)
            record = current.record
        try:
            turn = record.token_turn(prompt)
            result = await self._sample_turn(current, turn, request.token_limit(), stops)
            record.commit(turn, result.token_ids, result.logprobs, result.finished, None)
        finally:
            self._release(current)
        choice = self._completion_choice(0, result, stops, request.logprobs)
        return response("completion", self.model_name, prompt, [choice], len(result.token_ids))

    # ------------------------------------------------------------------------------------------- helpers

    def _claim(self, key: str, n: int) -> _Episode:
        episode = self._episodes.get(key)
        if episode is None:
            raise APIError(
                404,
                "this episode is closed or unknown: its agent finished or ran out of time",
                code="episode_closed",
            )
        if n != 1:
            raise APIError(400, "an episode's requests sample one choice (n=1)", param="n")
        if episode.busy:
            raise APIError(400, "an episode sends one request at a time; wait for the previous reply")
        if episode.record.requests >= self.limits.max_requests_per_episode:
            raise APIError(
                400,
                f"this episode made its {self.limits.max_requests_per_episode} requests "
                "(env.agent.max_requests); finish the episode",
                code="episode_request_limit",
            )
        episode.busy = True
        return episode

    async def _sample_turn(
        self, episode: _Episode, turn: Turn, limit: int | None, stops: tuple[str, ...]
    ) -> GenerationResult:
        record = episode.record
        room = self._room(len(turn.prompt_ids))
        if room <= 0:
            record.cut = True
        self._check_room(len(turn.prompt_ids), limit)
        params = replace(
            episode.params,
            max_new_tokens=min(limit or episode.params.max_new_tokens, episode.params.max_new_tokens, room),
            stop_strings=stops,
        )
        seed = turn_seed(record.seed, record.requests)
        (result,) = await self._sample([turn.prompt_ids], params, [seed])
        return result

    def _room(self, prompt_tokens: int) -> int:
        return self.limits.max_seq_len - prompt_tokens

    def _check_room(self, prompt_tokens: int, limit: int | None) -> None:
        room = self._room(prompt_tokens)
        if room <= 0:
            raise APIError(
                400,
                f"the prompt is {prompt_tokens} tokens; this model's budget is {self.limits.max_seq_len} "
                "tokens of prompt and reply together",
                code="context_length_exceeded",
                param="messages",
            )
        if limit is not None and limit > room:
            raise APIError(
                400,
                f"max_tokens={limit} does not fit: the prompt is {prompt_tokens} tokens and the budget "
                f"{self.limits.max_seq_len} tokens of prompt and reply together (at most {room} here)",
                code="context_length_exceeded",
                param="max_tokens",
            )

    def _plain_params(
        self, request: ChatCompletionRequest | CompletionRequest, prompt_tokens: int, stops: tuple[str, ...]
    ) -> tuple[SamplingParams, list[int]]:
        limit = request.token_limit()
        self._check_room(prompt_tokens, limit)
        temperature = 1.0 if request.temperature is None else request.temperature
        top_k = request.top_k if request.top_k and request.top_k > 0 else None
        # temperature 0 is greedy: the most likely token, whose logprob is still reported (top-k 1 at 1.0)
        params = SamplingParams(
            max_new_tokens=min(limit or self.limits.max_new_tokens, self._room(prompt_tokens)),
            temperature=temperature if temperature > 0 else 1.0,
            top_p=1.0 if request.top_p is None or temperature == 0 else request.top_p,
            top_k=top_k if temperature > 0 else 1,
            stop_strings=stops,
        )
        seed = request.seed if request.seed is not None else secrets.randbits(62)
        return params, row_seeds(seed, request.n)

    async def _plain_chat(
        self,
        request: ChatCompletionRequest,
        prompt: list[int],
        tools: tuple[Any, ...],
        stops: tuple[str, ...],
    ) -> dict[str, Any]:
        params, seeds = self._plain_params(request, len(prompt), stops)
        results = await self._sample([prompt] * len(seeds), params, seeds)
        choices = []
        for i, result in enumerate(results):
            reply = reply_message(_strip_stops(result.text, request.stop_strings()), tools)
            choices.append(self._chat_choice(i, result, reply, request.logprobs))
        return response("chat", self.model_name, prompt, choices, sum(len(r.token_ids) for r in results))

    async def _sample(
        self, prompts: list[list[int]], params: SamplingParams, seeds: Sequence[int]
    ) -> list[GenerationResult]:
        futures = [self.queue.submit(p, params, s) for p, s in zip(prompts, seeds, strict=True)]
        try:
            return list(await asyncio.gather(*(asyncio.wrap_future(f) for f in futures)))
        except Exception as exc:
            raise APIError(500, f"generation failed: {exc}", kind="server_error") from exc

    def _render(self, messages: Sequence[ChatMessage], tools: Sequence[Any]) -> list[int]:
        if self.tokenizer.chat_template is None:
            raise APIError(400, "this model has no chat template; use /v1/completions")
        try:
            text = self.tokenizer.apply_chat_template(
                [m.for_template() for m in messages],
                tools=tool_schemas(tools),
                tokenize=False,
                add_generation_prompt=True,
            )
        except Exception as exc:
            raise APIError(
                400, f"the chat template cannot render these messages: {exc}", param="messages"
            ) from None
        assert isinstance(text, str)
        return encode_conversation(self.tokenizer, text)

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt)["input_ids"])
        vocab = len(self.tokenizer)
        if not prompt or any(not 0 <= i < vocab for i in prompt):
            raise APIError(400, f"prompt token ids must be a non-empty list in [0, {vocab})", param="prompt")
        return list(prompt)

    def _pieces(self, ids: Sequence[int]) -> list[str]:
        return [str(self.tokenizer.decode([i])) for i in ids]

    def _chat_choice(
        self, index: int, result: GenerationResult, reply: ChatMessage, logprobs: bool
    ) -> dict[str, Any]:
        finish = "tool_calls" if reply.tool_calls else ("stop" if result.finished else "length")
        choice: dict[str, Any] = {
            "index": index,
            "message": message_json(reply),
            "finish_reason": finish,
            "logprobs": {"content": token_logprobs(self._pieces(result.token_ids), result.logprobs)}
            if logprobs
            else None,
            "token_ids": list(result.token_ids),
        }
        return choice

    def _completion_choice(
        self, index: int, result: GenerationResult, stops: tuple[str, ...], logprobs: int | None
    ) -> dict[str, Any]:
        pieces = self._pieces(result.token_ids)
        offsets, at = [], 0
        for piece in pieces:
            offsets.append(at)
            at += len(piece)
        return {
            "index": index,
            "text": _strip_stops(result.text, stops),
            "finish_reason": "stop" if result.finished else "length",
            "logprobs": None
            if logprobs is None
            else {
                "tokens": pieces,
                "token_logprobs": list(result.logprobs),
                "top_logprobs": None,
                "text_offset": offsets,
            },
            "token_ids": list(result.token_ids),
        }


def _strip_stops(text: str, stops: Sequence[str]) -> str:
    """The reply's text without the stop string that ended it (the OpenAI API's convention; the tokens of the
    stop string stay in the record)."""
    for stop in stops:
        if text.endswith(stop):
            return text[: -len(stop)]
    return text
