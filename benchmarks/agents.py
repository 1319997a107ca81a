"""The calculator task trained two ways, same start and seeds: rlfleet's own turn loop (the ``tools``
environment) and an agent that speaks only the OpenAI API to rlfleet's endpoint
(``rlfleet.examples.calculator_agent``, ``data.env_name=agent``); then the endpoint's throughput with many
concurrent agents.

Part 1 rows (``grpo-tiny-multiplication-tools-cpu`` and ``grpo-tiny-multiplication-agent-cpu`` from the same
SFT model, ``--steps`` steps each, validated on the same held-out problems): validation accuracy at each
validation step, steps per minute, and the endpoint's overhead (the agent run's time per step over the turn
loop's). The two runs sample the same tokens where the agent does what the environment does, so their
curves should match; a difference is the cost or the behaviour of the HTTP path.

Part 2: ``--agents`` concurrent agents (one request each, ``--tokens`` new tokens) against the endpoint, and
the same prompts given straight to the backend in one ``generate_rows`` call: requests per second of both,
and the ratio (the HTTP, JSON and batching overhead).

    .venv/bin/python benchmarks/agents.py                 # ~20 min on 2 cores (SFT reused from --out)
    .venv/bin/python benchmarks/agents.py --quick         # a smoke run: tiny untrained model, 2 steps
"""

from __future__ import annotations

import argparse
import concurrent.futures
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: benchmarks/ importable

from benchmarks.environments import SFT, sft_model

from rlfleet.algorithms.grpo.loop import grpo_train
from rlfleet.config import load_recipe, resolve_recipe_path
from rlfleet.demo import ensure_tiny_model, stage_overrides, val_accuracy_curve
from rlfleet.generation import HFGenerationBackend, SamplingParams
from rlfleet.logging import read_metrics

TOOLS = "grpo-tiny-multiplication-tools-cpu"
AGENT = "grpo-tiny-multiplication-agent-cpu"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench_agents"))
    parser.add_argument("--quick", action="store_true", help="tiny untrained model, 2 GRPO steps, 8 agents")
    parser.add_argument("--steps", type=int, default=20, help="GRPO steps of each run (default 20)")
    parser.add_argument("--agents", type=int, default=64, help="concurrent agents of part 2 (default 64)")
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per request of part 2")
    parser.add_argument("--skip-training", action="store_true", help="part 2 only")
    return parser.parse_args(argv)


def train(recipe: str, out: Path, name: str, model: Path, overrides: list[str]) -> tuple[list, float, int]:
    """One GRPO run; its validation curve, its training seconds (validation excluded) and its steps."""
    cfg = load_recipe(resolve_recipe_path(recipe), [*stage_overrides(out, name, model), *overrides])
    grpo_train(cfg)
    log_dir = Path(cfg.logger.log_dir)
    steps = [r for r in read_metrics(log_dir) if "train/loss" in r]
    seconds = sum(r.get("timing/total", 0.0) for r in steps)
    return val_accuracy_curve(log_dir), seconds, len(steps)


def throughput(model_dir: Path, agents: int, tokens: int) -> tuple[float, float]:
    """Requests per second through the endpoint (``agents`` concurrent clients), and straight to the
    backend."""
    import openai
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlfleet.serving.engine import PolicyEndpoint, ServingLimits
    from rlfleet.serving.server import ServerSettings, ServerThread

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    backend = HFGenerationBackend(
        AutoModelForCausalLM.from_pretrained(model_dir), tokenizer, batch_size=agents
    )
    questions = [f"What is {1000 + 37 * i} * {2000 + 91 * i}?" for i in range(agents)]
    params = SamplingParams(max_new_tokens=tokens)
    endpoint = PolicyEndpoint(backend, tokenizer, "policy", ServingLimits(512, tokens))
    server = ServerThread(endpoint, ServerSettings())
    clients = [
        openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0) for _ in range(agents)
    ]
    try:

        def ask(i: int) -> int:
            messages = [{"role": "user", "content": questions[i]}]
            reply = clients[i].chat.completions.create(
                model="policy", messages=messages, max_tokens=tokens, seed=i
            )
            return reply.usage.completion_tokens if reply.usage else 0

        ask(0)  # warm-up
        calls = endpoint.queue.calls
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(agents) as pool:
            list(pool.map(ask, range(agents)))
        served = agents / (time.perf_counter() - start)
        print(f"the endpoint sampled the {agents} requests in {endpoint.queue.calls - calls} engine call(s)")
    finally:
        for client in clients:
            client.close()
        server.close()
        endpoint.close()
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        for q in questions
    ]
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    start = time.perf_counter()
    backend.generate_rows(ids, params, list(range(agents)))
    direct = agents / (time.perf_counter() - start)
    return served, direct


def main() -> None:
    args = parse_args()
    out: Path = args.out.resolve()
    quick_sft = ["sft.max_num_steps=2", "sft.val_period=2", "sft.val_at_start=false"] if args.quick else []
    cfg = load_recipe(resolve_recipe_path(SFT), [*stage_overrides(out, "sft_tool", out), *quick_sft])
    base = ensure_tiny_model(out / "base_model", cfg, seed=cfg.sft.seed)
    model, _ = sft_model(out, "sft_tool", base, quick_sft)
    steps = 2 if args.quick else args.steps
    grpo = [
        f"grpo.max_num_steps={steps}",
        f"grpo.val_period={max(steps // 4, 1)}",
        "grpo.max_val_samples=64",
        "checkpointing.save_period=1000",
        "logger.tensorboard_enabled=false",
    ]
    if args.quick:
        grpo += [
            "grpo.num_prompts_per_step=2",
            "policy.train_global_batch_size=16",
            "policy.train_micro_batch_size=16",
        ]
    if not args.skip_training:
        rows = [
            ("turn loop (tools env)", *train(TOOLS, out, "tools", model, grpo)),
            ("OpenAI-API agent", *train(AGENT, out, "agent", model, grpo)),
        ]
        print(f"\n{'row':<24} {'validation accuracy by step':<52} {'steps/min':>9} {'s/step':>7}")
        for name, curve, seconds, n in rows:
            points = " ".join(f"{s}:{a:.1%}" for s, a in curve)
            print(f"{name:<24} {points:<52} {60 * n / seconds:>9.2f} {seconds / n:>7.1f}")
        loop_s, agent_s = rows[0][2] / rows[0][3], rows[1][2] / rows[1][3]
        print(f"endpoint overhead: the agent's step takes {agent_s / loop_s:.2f}x the turn loop's")
    agents = 8 if args.quick else args.agents
    served, direct = throughput(model, agents, args.tokens)
    print(f"\n{agents} concurrent agents, {args.tokens} new tokens each (HF backend, {model.name})")
    print(f"{'path':<28} {'requests/s':>10}")
    print(f"{'endpoint (HTTP, batched)':<28} {served:>10.1f}")
    print(f"{'backend generate_rows':<28} {direct:>10.1f}")
    print(f"endpoint / backend: {served / direct:.2f}x")


if __name__ == "__main__":
    main()
