"""Dense rewards for tests: an untrained model must see reward variance inside its groups."""


def digit_fraction_reward(prompt: str, response: str, gold: str) -> float:
    """Fraction of characters that are digits: varies across samples of any model."""
    del prompt, gold
    return sum(c.isdigit() for c in response) / max(len(response), 1)


def digits_for_even_gold_reward(prompt: str, response: str, gold: str) -> float:
    """``digit_fraction_reward`` for problems whose answer is even, 0 for the others: about half the groups
    carry a signal and the rest are all equal (DAPO's dynamic sampling drops them)."""
    if not gold.lstrip("-").isdigit() or int(gold) % 2:
        return 0.0
    return digit_fraction_reward(prompt, response, gold)


def constant_reward(prompt: str, response: str, gold: str) -> float:
    """0.5 for everything: no group ever carries a signal."""
    del prompt, response, gold
    return 0.5


def even_length_reward(prompt: str, response: str, gold: str) -> float:
    """1.0 for a response of an even number of characters, else 0.0: about half the samples of any model
    are correct, so pass@1 and pass@k of a group are neither 0 nor 1."""
    del prompt, gold
    return 1.0 if len(response) % 2 == 0 else 0.0


def first_digit_reward(prompt: str, response: str, gold: str) -> float:
    """1.0 when the response's first digit is the gold's first digit: varies across samples of any model."""
    del prompt
    digits = [c for c in response if c.isdigit()]
    return 1.0 if digits and gold and digits[0] == gold[0] else 0.0
