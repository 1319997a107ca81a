"""``rlfleet eval``: pass@1 and pass@k of a model or checkpoint on a validation set."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from math import comb
from pathlib import Path

from rlfleet.algorithms.common import build_policy, build_verifier, load_prompts
from rlfleet.config import MasterConfig
from rlfleet.generation import SamplingParams


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` are correct (Chen et al., 2021)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


@dataclass(frozen=True)
class EvalReport:
    model: str
    checkpoint: str | None
    num_prompts: int
    samples_per_prompt: int
    greedy: bool
    k: int
    pass_at_1: float
    pass_at_k: float
    mean_response_length: float
    seconds: float

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    def table(self) -> str:
        mode = "greedy" if self.greedy else f"{self.samples_per_prompt} samples/prompt"
        return "\n".join(
            [
                f"model        {self.model}"
                + (f" (checkpoint {self.checkpoint})" if self.checkpoint else ""),
                f"prompts      {self.num_prompts} ({mode})",
                f"pass@1       {self.pass_at_1:.4f}",
                *([f"pass@{self.k:<7} {self.pass_at_k:.4f}"] if self.k > 1 else []),
                f"mean length  {self.mean_response_length:.1f} tokens",
                f"time         {self.seconds:.1f} s",
            ]
        )


def run_eval(cfg: MasterConfig, checkpoint: Path | None = None) -> EvalReport:
    """Generates ``eval.num_tests_per_prompt`` responses per validation prompt and scores them."""
    start = time.perf_counter()
    e, gen = cfg.eval, cfg.policy.generation
    worker, backend = build_policy(cfg, seed=e.seed, keep_reference=False)
    try:
        if checkpoint is not None:
            worker.load_weights(checkpoint)
            backend.refit()
        prompts = load_prompts(cfg, worker.tokenizer, e.max_val_samples or 10**9).val
        n, greedy = e.num_tests_per_prompt, e.num_tests_per_prompt == 1
        params = SamplingParams(gen.max_new_tokens, gen.temperature, gen.top_p, gen.top_k, greedy=greedy)
        repeated = [p for p in prompts for _ in range(n)]
        results = backend.generate([p.token_ids for p in repeated], params, seed=e.seed)
        with build_verifier(cfg) as verifier:
            items = [(p.text, r.text, p.example.gold) for p, r in zip(repeated, results, strict=True)]
            rewards = verifier.score(items).rewards
    finally:
        worker.close()
    correct = [sum(1 for x in rewards[i * n : (i + 1) * n] if x > 0.5) for i in range(len(prompts))]
    count = max(len(prompts), 1)
    return EvalReport(
        model=cfg.policy.model_name,
        checkpoint=str(checkpoint) if checkpoint else None,
        num_prompts=len(prompts),
        samples_per_prompt=n,
        greedy=greedy,
        k=e.pass_k_value,
        pass_at_1=sum(pass_at_k(n, c, 1) for c in correct) / count,
        pass_at_k=sum(pass_at_k(n, c, e.pass_k_value) for c in correct) / count,
        mean_response_length=sum(len(r.token_ids) for r in results) / max(len(results), 1),
        seconds=time.perf_counter() - start,
    )
