"""Small programs written against rlfleet's public surfaces, shipped so that recipes can name them (the
agent of ``recipes/grpo-tiny-multiplication-agent-cpu.yaml``) and users can copy them."""
