"""Episodes played by agents that speak the OpenAI API (the ``agent`` environment), many at once.

The first time a run rolls out agent episodes it starts an OpenAI-compatible endpoint in front of its
generation backend (:mod:`rlfleet.serving`; 127.0.0.1, a free port, agent episodes only). Each episode gets
a URL of its own (``http://127.0.0.1:<port>/episodes/<key>/v1``) and its agent runs with a client for it:
synchronous agents in threads, ``async`` ones on an event loop, at most ``env.agent.max_concurrency`` at a
time, each within ``env.agent.timeout_s``. Requests from all the agents are sampled together in batches.

An agent that raises, returns something that is not a finite number, or runs out of time costs its own
episode only: reward 0, counted in ``train/reward_errors`` or ``train/reward_timeouts``, the first error
logged. Its URL is closed when its time is up, so a late request is refused and cannot touch the next
training step (a synchronous function that never returns keeps its thread, a daemon, until the process
ends).

Once the agents are done, each episode's record becomes its training sequence (the last segment's tokens,
exactly as sampled) with the agent's reward.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, replace
from typing import Any

from transformers import PreTrainedTokenizerBase

from rlfleet.environments.agent import AgentEnvironment
from rlfleet.generation import GenerationBackend, SamplingParams
from rlfleet.rollouts.conversation import Episode
from rlfleet.serving.engine import PolicyEndpoint, ServingLimits
from rlfleet.serving.record import EpisodeRecord
from rlfleet.serving.server import ServerSettings, ServerThread

log = logging.getLogger(__name__)

_POLL_S = 0.01


@dataclass
class _Outcome:
    reward: float = 0.0
    error: BaseException | None = None
    timed_out: bool = False


class AgentDriver:
    """Runs an agent environment's episodes through the run's endpoint (see the module docstring)."""

    def __init__(
        self,
        environment: AgentEnvironment,
        backend: GenerationBackend,
        tokenizer: PreTrainedTokenizerBase,
        max_seq_len: int,
    ) -> None:
        self.environment, self.tokenizer = environment, tokenizer
        limits = ServingLimits(max_seq_len, max_seq_len, environment.max_requests)
        self.endpoint = PolicyEndpoint(
            backend, tokenizer, environment.served_model_name, limits, episodes_only=True
        )
        try:
            self.server = ServerThread(self.endpoint, ServerSettings())
        except BaseException:
            self.endpoint.close()
            raise
        self._errors_logged = 0
        # one connection pool for every episode's client (a client of its own would build an SSL context
        # each: ~30 ms of CPU per episode)
        self._http: Any = None
        environment.on_close(self.close)

    def close(self) -> None:
        if self._http is not None:
            self._http.close()
        self.server.close()
        self.endpoint.close()

    def run(self, episodes: Sequence[Episode], params: SamplingParams) -> tuple[int, int, dict[str, float]]:
        """Plays ``episodes`` (filling in their tokens, reward and counters); returns the number that timed
        out, the number that failed, and the agents' metrics.

        An episode's URL opens when its agent starts and closes as soon as it ends (finished, failed or out
        of time), so the engine's calls wait only for the agents still playing."""
        urls = _Urls(self.endpoint, self.server.base_url, [e.seed for e in episodes], params)
        tasks = [_task(e) for e in episodes]
        try:
            if self.environment.is_async:
                outcomes = _in_a_loop_of_its_own(lambda: self._run_async(tasks, urls))
            else:
                outcomes = self._run_threads(tasks, urls)
        finally:
            records = urls.close_all()
        for episode, record, outcome in zip(episodes, records, outcomes, strict=True):
            self._fill(episode, record, outcome)
        n = max(len(episodes), 1)
        metrics = {
            "agent/requests_per_episode": sum(r.requests for r in records) / n,
            "agent/history_edits": sum(r.history_edits for r in records) / n,
            "agent/dropped_tokens": sum(r.dropped_tokens for r in records) / n,
        }
        timeouts = sum(o.timed_out for o in outcomes)
        errors = sum(o.error is not None for o in outcomes)
        return timeouts, errors, metrics

    # --------------------------------------------------------------------------------------------- agents

    def _call(self, task: dict[str, Any], url: str) -> float:
        import openai

        client = openai.OpenAI(
            base_url=url,
            api_key="rlfleet",
            max_retries=0,
            timeout=self.environment.timeout_s,
            http_client=self._http,
        )
        return _reward(self.environment.agent_fn(task, client, self.environment.served_model_name))

    def _run_threads(self, tasks: list[dict[str, Any]], urls: _Urls) -> list[_Outcome]:
        if self._http is None:
            import openai

            self._http = openai.DefaultHttpxClient(timeout=self.environment.timeout_s)
        played = [_Outcome() for _ in tasks]  # written by the agents' threads
        outcomes = [_Outcome(timed_out=True) for _ in tasks]  # what the run keeps
        finished = [threading.Event() for _ in tasks]

        def play(i: int, url: str) -> None:
            try:
                played[i].reward = self._call(tasks[i], url)
            except BaseException as exc:  # the agent's failure costs its episode
                played[i].error = exc
            finally:
                finished[i].set()

        waiting, running = list(range(len(tasks))), dict[int, float]()
        while waiting or running:
            while waiting and len(running) < self.environment.max_concurrency:
                i = waiting.pop(0)
                thread = threading.Thread(target=play, args=(i, urls.open(i)), name=f"rlfleet-agent-{i}")
                thread.daemon = True  # one that never returns must not keep the process alive
                thread.start()
                running[i] = time.monotonic() + self.environment.timeout_s
            for i, deadline in list(running.items()):
                if finished[i].is_set():
                    outcomes[i] = played[i]
                elif time.monotonic() <= deadline:
                    continue
                # done, or out of time (the thread is abandoned): its URL closes now
                urls.close(i)
                del running[i]
            time.sleep(_POLL_S)
        return outcomes

    async def _run_async(self, tasks: list[dict[str, Any]], urls: _Urls) -> list[_Outcome]:
        import openai

        slots = asyncio.Semaphore(self.environment.max_concurrency)
        http = openai.DefaultAsyncHttpxClient(timeout=self.environment.timeout_s)  # of this event loop

        async def play(i: int) -> _Outcome:
            async with slots:
                client = openai.AsyncOpenAI(
                    base_url=urls.open(i),
                    api_key="rlfleet",
                    max_retries=0,
                    timeout=self.environment.timeout_s,
                    http_client=http,
                )
                try:
                    call = self.environment.agent_fn(tasks[i], client, self.environment.served_model_name)
                    return _Outcome(_reward(await asyncio.wait_for(call, self.environment.timeout_s)))
                except TimeoutError:
                    return _Outcome(timed_out=True)
                except Exception as exc:
                    return _Outcome(error=exc)
                finally:
                    await asyncio.to_thread(urls.close, i)

        try:
            return list(await asyncio.gather(*(play(i) for i in range(len(tasks)))))
        finally:
            await http.aclose()

    # -------------------------------------------------------------------------------------------- records

    def _fill(self, episode: Episode, record: EpisodeRecord, outcome: _Outcome) -> None:
        """The episode as the agent played it: its last segment's tokens, the agent's reward."""
        if outcome.error is not None:
            self._log_error(outcome.error)
        failed = outcome.error is not None or outcome.timed_out
        episode.reward = 0.0 if failed else outcome.reward
        episode.failed, episode.done, episode.turns = failed, True, record.requests
        episode.cut = record.cut
        episode.last_turn_finished = record.last_finished
        segment = record.current
        if segment is not None:
            text = str(self.tokenizer.decode(segment.prompt_ids, skip_special_tokens=False))
            episode.prompt = replace(episode.prompt, token_ids=tuple(segment.prompt_ids), text=text)
            episode.token_ids, episode.logprobs, episode.mask = (
                segment.token_ids,
                segment.logprobs,
                segment.mask,
            )
        if record.conversation:
            episode.messages = record.conversation
        metadata = episode.metadata if isinstance(episode.metadata, dict) else {}
        episode.metadata = {
            **metadata,
            "agent_requests": record.requests,
            "history_edits": record.history_edits,
        }

    def _log_error(self, exc: BaseException) -> None:
        self._errors_logged += 1
        if self._errors_logged == 1:
            log.warning(
                "an agent failed (%s: %s); its episode ends with reward 0 and counts in train/reward_errors; "
                "further agent errors are counted, not logged",
                type(exc).__name__,
                str(exc)[:500],
            )


class _Urls:
    """The episodes' URLs: each opened when its agent starts, closed (its record kept) when it ends."""

    def __init__(
        self, endpoint: PolicyEndpoint, base_url: str, seeds: list[int], params: SamplingParams
    ) -> None:
        self.endpoint, self.base_url, self.seeds, self.params = endpoint, base_url, seeds, params
        self.keys: list[str | None] = [None] * len(seeds)
        self.records: list[EpisodeRecord | None] = [None] * len(seeds)
        self._lock = threading.Lock()

    def open(self, i: int) -> str:
        key = self.endpoint.open_episode(self.seeds[i], self.params)
        self.keys[i] = key
        return f"{self.base_url}/episodes/{key}/v1"

    def close(self, i: int) -> None:
        with self._lock:
            key, self.keys[i] = self.keys[i], None
        if key is not None:
            (self.records[i],) = self.endpoint.close_episodes([key])

    def close_all(self) -> list[EpisodeRecord]:
        """Closes what is still open; an episode whose agent never started has an empty record."""
        for i in range(len(self.keys)):
            self.close(i)
        return [
            r if r is not None else EpisodeRecord(seed)
            for r, seed in zip(self.records, self.seeds, strict=True)
        ]


def _in_a_loop_of_its_own(make: Callable[[], Coroutine[Any, Any, list[_Outcome]]]) -> list[_Outcome]:
    """Runs the coroutine on an event loop in a thread of its own (the caller's thread may already run one:
    a notebook's)."""
    result: list[list[_Outcome]] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            result.append(asyncio.run(make()))
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=run, name="rlfleet-agents", daemon=True)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return result[0]


def _task(episode: Episode) -> dict[str, Any]:
    """What the agent function receives: the row's fields and the conversation rlfleet would start with."""
    metadata = episode.metadata if isinstance(episode.metadata, dict) else {}
    return {
        "question": episode.prompt.example.question,
        **metadata,
        "messages": [dict(m) for m in episode.messages],
    }


def _reward(value: Any) -> float:
    if not isinstance(value, int | float) or not math.isfinite(value):
        raise TypeError(
            f"an agent must return its episode's reward, a finite number; it returned {value!r:.80}"
        )
    return float(value)
