"""rlfleet: GRPO post-training of language models, from a laptop CPU to a Ray cluster."""

__version__ = "0.1.0"
