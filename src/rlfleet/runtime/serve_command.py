"""``rlfleet serve``: a recipe's model, or a trained checkpoint, behind the OpenAI-compatible endpoint.

The model is built as training builds it (the recipe's generation backend: HF or vLLM, in this process or on
Ray), with a checkpoint's weights loaded into it, and served until the process is stopped (Ctrl-C, SIGTERM).
Requests sample with their own settings (``temperature``, ``top_p``, ``seed``, ``n``, ``max_tokens``),
bounded by the recipe's ``policy.max_total_sequence_length``; ``policy.generation.max_new_tokens`` is the
reply length of a request that names none.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from rlfleet.config import MasterConfig
from rlfleet.config.layout import resource_layout
from rlfleet.runtime.components import build_policy
from rlfleet.serving.engine import PolicyEndpoint, ServingLimits
from rlfleet.serving.server import ServerSettings, ServerThread, check_settings

SERVE_SEED = 0
"""The seed the served model is built with. Nothing a reply holds depends on it: every request samples with
its own seed (the request's, else one drawn for it), and the weights are the model's or the checkpoint's.
Not a recipe key: serving is no algorithm, so it reads no algorithm's section (``grpo.seed`` and the like)."""


def serve(
    cfg: MasterConfig,
    checkpoint: Path | None,
    settings: ServerSettings,
    model_name: str,
    ready: Callable[[str], None],
    stop: threading.Event | None = None,
) -> None:
    """Serves until ``stop`` is set (or the process is interrupted); ``ready`` gets the base URL
    (``http://host:port/v1``) once requests are accepted."""
    check_settings(settings)  # before the model loads
    policy, backend = build_policy(cfg, resource_layout(cfg), seed=SERVE_SEED, keep_reference=False)
    try:
        if checkpoint is not None:
            policy.load_weights(checkpoint)
            backend.refit()
        limits = ServingLimits(cfg.policy.max_total_sequence_length, cfg.policy.generation.max_new_tokens)
        endpoint = PolicyEndpoint(backend, policy.tokenizer, model_name, limits)
        try:
            server = ServerThread(endpoint, settings)
            try:
                ready(f"{server.base_url}/v1")
                (stop or threading.Event()).wait()
            finally:
                server.close()
        finally:
            endpoint.close()
    finally:
        policy.close()
