"""Generation memory grows with B x N, not B x N x V: 64 x 64 tokens from a 150k vocabulary.

Keeping every step's logits, as the backend did before issue 9, costs 64 x 64 x 150,000 x 4 bytes = 2.5 GB
for the stacked float32 logits alone (and as much again for the tuple they are stacked from). The run is in
a fresh subprocess, so its peak resident memory (``ru_maxrss``) is this generation's; an address-space limit
stops a regression at a few GB before it takes the machine's memory.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

BOUND_MB = 1024  # two fifths of one [64, 64, 150k] float32 tensor
ADDRESS_SPACE_LIMIT_GB = 4

CHILD = f"""
import json, resource
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from rlfleet.generation import HFGenerationBackend, SamplingParams

torch.set_num_threads(2)

class Tokenizer:
    pad_token_id, eos_token_id = 0, 1
    def decode(self, ids, skip_special_tokens=True):
        return ""

def resident_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20

torch.manual_seed(0)
config = LlamaConfig(
    vocab_size=150_000, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
    num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
)
backend = HFGenerationBackend(LlamaForCausalLM(config), Tokenizer(), batch_size=64)
prompts = [[2 + (7 * row + j) % 1000 for j in range(8 + row % 9)] for row in range(64)]
before = resident_mb()
limit = {ADDRESS_SPACE_LIMIT_GB} * 2**30
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
error, lengths = None, []
try:
    results = backend.generate(prompts, SamplingParams(max_new_tokens=64), seed=0)
    lengths = [len(r.token_ids) for r in results]
except RuntimeError as e:  # out of address space
    error = str(e)[:300]
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({{"peak_delta_mb": peak - before, "lengths": lengths, "error": error}}))
"""


@pytest.mark.slow
def test_64_x_64_tokens_from_a_150k_vocabulary_stay_under_a_gigabyte() -> None:
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["error"] is None, f"generation ran out of {ADDRESS_SPACE_LIMIT_GB} GB: {report['error']}"
    assert len(report["lengths"]) == 64 and sum(report["lengths"]) > 64 * 50
    assert report["peak_delta_mb"] < BOUND_MB, report["peak_delta_mb"]
