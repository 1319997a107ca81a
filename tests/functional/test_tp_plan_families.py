"""rlfleet's tensor-parallel plan on every supported family, from tiny configs built on the meta device in a
fake world of 2 tensor-parallel ranks: every linear weight of every decoder layer split (Llama, SmolLM2,
Qwen2, Qwen3, Gemma 3's text model; Gemma 3's conditional-generation layout is
``test_gemma3_conditional.py``'s), and a mixture-of-experts model (Qwen3-MoE) refused with the layout named,
rather than its experts silently held whole on every rank."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json
import torch
import torch.distributed as dist
import transformers
from torch.testing._internal.distributed.fake_pg import FakeStore
from rlfleet.policy.parallelize import build_mesh, parallelize, unsharded_linears

small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)
families = {
    "llama": transformers.LlamaConfig(**small),
    "smollm2": transformers.LlamaConfig(**small, tie_word_embeddings=True),
    "qwen2": transformers.Qwen2Config(**small),
    "qwen3": transformers.Qwen3Config(**small, head_dim=16),
    "gemma3_text": transformers.Gemma3TextConfig(**small, head_dim=16, sliding_window=16),
    "qwen3_moe": transformers.Qwen3MoeConfig(**small, num_experts=4, num_experts_per_tok=2,
                                             moe_intermediate_size=32),
}
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
mesh = build_mesh(2, "cpu")
found = {}
for name, config in families.items():
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    try:
        parallelize(model, mesh, activation_checkpointing=False)
    except ValueError as exc:
        found[name] = {"refused": str(exc)}
        continue
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    found[name] = {"unsharded": unsharded_linears(model, 2), "linears": linears}
print(json.dumps(found))
"""


def test_every_family_has_every_projection_split_and_moe_is_refused() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, check=False, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    for family in ("llama", "smollm2", "qwen2", "qwen3", "gemma3_text"):
        assert found[family]["unsharded"] == [], family
        assert found[family]["linears"] >= 2 * 7, family  # q, k, v, o, gate, up, down in each layer
    refused = found["qwen3_moe"]["refused"]
    assert "mlp.gate_proj" in refused and "Qwen3MoeForCausalLM" in refused
