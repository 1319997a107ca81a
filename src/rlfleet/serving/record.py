"""What an agent's episode sampled, token for token: the record training reads.

Every request an agent sends on its episode's URL is one turn. The first renders the request's messages
with the chat template (``/v1/completions``: the prompt's ids); each later one whose history *extends* the
previous turn (the previous request's messages, then the reply the server gave, then new messages: tool
results, a user's answer) is given to the engine as the previous turn's exact tokens, the sampled ones
included, followed by the new messages rendered as the template renders what follows an assistant turn.
So the engine sees, and training reads, the tokens it sampled, never a re-tokenisation of their text.

A request whose history does *not* extend the previous turn (the agent edited, summarised or dropped earlier
messages, or changed its tools) starts a new **segment**: the request is rendered afresh, and the episode's
training sequence becomes that segment; the earlier segments are dropped from training and counted
(``agent/history_edits``; ``agent/dropped_tokens``). The episode's reward is paid to the tokens of its last
segment, those that produced its outcome, in the context the model actually saw.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from rlfleet.serving.chat import ChatMessage


@dataclass
class Segment:
    """One unbroken token sequence: the first prompt, then every observation (mask 0) and sample (mask 1)."""

    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)

    def context(self) -> list[int]:
        return [*self.prompt_ids, *self.token_ids]

    def append(self, ids: Sequence[int], logprobs: Sequence[float] | None) -> None:
        self.token_ids.extend(ids)
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))
        self.mask.extend([1 if logprobs is not None else 0] * len(ids))

    @property
    def sampled(self) -> int:
        return sum(self.mask)


@dataclass(frozen=True)
class Turn:
    """A request's place in its episode: the ids the engine is given, and how they relate to the record.

    ``observation`` is None when the request starts a new segment (its ``prompt_ids`` are all fresh)."""

    prompt_ids: list[int]
    observation: list[int] | None
    history: tuple[ChatMessage, ...] | None
    tools_key: str | None


@dataclass
class EpisodeRecord:
    """The turns of one agent episode (see the module docstring)."""

    seed: int
    segments: list[Segment] = field(default_factory=list)
    history: tuple[ChatMessage, ...] | None = None  # the latest chat request's messages and its reply
    tools_key: str | None = None
    requests: int = 0
    history_edits: int = 0
    last_finished: bool = True
    cut: bool = False  # a request did not fit in the sequence budget
    conversation: list[dict[str, str]] = field(default_factory=list)

    @property
    def current(self) -> Segment | None:
        return self.segments[-1] if self.segments else None

    def extends(
        self, messages: Sequence[ChatMessage], tools_key: str | None
    ) -> tuple[ChatMessage, ...] | None:
        """The new messages when ``messages`` extend the latest turn's history (same tools), else None."""
        if self.history is None or self.current is None or tools_key != self.tools_key:
            return None
        n = len(self.history)
        if len(messages) <= n or tuple(messages[:n]) != self.history:
            return None
        return tuple(messages[n:])

    def token_turn(self, prompt_ids: Sequence[int]) -> Turn:
        """A completion request's turn: it extends the segment when its ids start with the segment's."""
        context = self.current.context() if self.current is not None else None
        if (
            context is not None
            and len(prompt_ids) >= len(context)
            and list(prompt_ids[: len(context)]) == context
        ):
            return Turn(list(prompt_ids), list(prompt_ids[len(context) :]), None, None)
        return Turn(list(prompt_ids), None, None, None)

    def commit(
        self,
        turn: Turn,
        sampled: Sequence[int],
        logprobs: Sequence[float],
        finished: bool,
        reply: ChatMessage | None,
    ) -> None:
        """Records a turn's sample (after the engine answered)."""
        self.requests += 1
        if turn.observation is None:
            if self.segments:
                self.history_edits += 1
            self.segments.append(Segment(list(turn.prompt_ids)))
        segment = self.segments[-1]
        segment.append(turn.observation or [], None)
        segment.append(sampled, logprobs)
        self.last_finished = finished
        if turn.history is not None and reply is not None:
            self.history, self.tools_key = (*turn.history, reply), turn.tools_key
            self.conversation = [m.for_template() for m in self.history]
        else:
            self.history, self.tools_key = None, None

    @property
    def dropped_tokens(self) -> int:
        """Sampled tokens of the segments before the last (not trained)."""
        return sum(s.sampled for s in self.segments[:-1])
