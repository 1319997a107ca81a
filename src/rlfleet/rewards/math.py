"""The binary math reward (answers are read by :mod:`rlfleet.answers`).

A reward function is a plain function ``(prompt, response, gold) -> float``; recipes pick one by dotted
path (``env.math.reward_fn``).

:func:`math_reward` first finds the response's final answer: the rest of the line after the last ``####``
(GSM8k), else the content of the last ``\\boxed{...}``, else the last number. When that answer and the
gold are both plain numbers (currency signs, thousands separators, a percent sign and trailing words such
as units allowed) they are compared exactly as fractions, which takes microseconds and settles nearly every
GSM8k-style response. Anything else (``\\frac{3}{4}``, ``3/4``, ``2^{10}``, a symbolic gold) goes to HF
math-verify, under a wall-clock budget.

The gold must be an answer, not a worked solution (:func:`gold_answer`): a gold holding ``#### N`` or a
``\\boxed{}`` is reduced to that answer first (GSM8k's whole ``answer`` field works), and a gold that is still
not an answer (empty, several lines, over 100 characters) raises :class:`InvalidGoldError`. That is a bug in
the data, not a wrong response, so it is never scored as a plain 0.0: a verifier pool counts it in
``num_errors`` (``train/reward_errors``), scores it 0.0 and logs the first one.
"""

from __future__ import annotations

from rlfleet.answers import MAX_ANSWER_CHARS, as_number, final_answer, gold_answer, plain_number
from rlfleet.rewards.verify import VerificationTimeout, symbolic_match, time_budget

DEFAULT_TIMEOUT_S = 5.0
"""Wall-clock budget of one in-process :func:`math_reward` call (the ``env.math.timeout_s`` default)."""


def answers_match(response: str, gold: str) -> bool:
    """Whether the final answer of ``response`` equals ``gold`` (:func:`gold_answer` of it): exactly for
    plain numbers, else by math-verify. Not time-bounded: see :func:`math_reward` and
    :class:`~rlfleet.pools.ProcessWorkerPool`.

    Raises:
        InvalidGoldError: ``gold`` is not an answer and cannot be reduced to one.
    """
    return _matches(response, gold_answer(gold))


def _matches(response: str, gold: str) -> bool:
    """:func:`answers_match` for a gold that is already an answer."""
    answer = final_answer(response)
    if answer is None or len(answer.text) > MAX_ANSWER_CHARS:
        return False
    wanted = as_number(gold)
    got = plain_number(answer.text) if answer.standalone else None
    if wanted is not None and got is not None:
        return wanted == got
    return symbolic_match(answer.expression, gold)


def math_reward(
    prompt: str, response: str, gold: str, *, timeout_s: float | None = DEFAULT_TIMEOUT_S
) -> float:
    """1.0 when the response's final answer equals ``gold`` (numerically or symbolically), else 0.0.

    Whatever the response, this never raises: an error or a check running past ``timeout_s`` gives 0.0. A
    gold that is not an answer (:func:`gold_answer`) raises :class:`InvalidGoldError` instead, because the
    data, not the response, is wrong: the verifier pools that score a training step count it in
    ``num_errors`` with reward 0.0 and log the first one (the step goes on); a caller that scores in process
    sees the exception. The budget is a ``SIGALRM`` timer, so it holds only on the main thread and only for
    Python code; inside a :class:`~rlfleet.pools.ProcessWorkerPool` worker the pool's own budget applies
    instead (a timeout there propagates so that the pool counts it), and a worker stuck in C code is killed.

    Args:
        prompt: The prompt (unused by this reward; part of the reward-function signature).
        response: The model's generated text.
        gold: The reference answer: a number such as ``"72"`` or ``"1,080"``, LaTeX (``"\\frac{3}{4}"``), or
            a worked solution ending in ``#### <answer>`` or ``\\boxed{<answer>}`` (reduced to that answer).
        timeout_s: Wall-clock budget of this call; None for unbounded.

    Raises:
        InvalidGoldError: ``gold`` is not an answer and cannot be reduced to one.
    """
    del prompt
    wanted = gold_answer(gold)  # linear string work, outside the budget: a bad gold must raise, not time out
    armed = False
    try:
        with time_budget(timeout_s) as armed:
            return 1.0 if _matches(response, wanted) else 0.0
    except VerificationTimeout:
        if not armed:
            raise  # an enclosing budget (a pool worker's) expired: let its owner count it
        return 0.0
    except Exception:  # a reward must never crash a training step
        return 0.0
