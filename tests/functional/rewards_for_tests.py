"""Dense rewards for tests: an untrained model must see reward variance inside its groups."""


def digit_fraction_reward(prompt: str, response: str, gold: str) -> float:
    """Fraction of characters that are digits: varies across samples of any model."""
    del prompt, gold
    return sum(c.isdigit() for c in response) / max(len(response), 1)
