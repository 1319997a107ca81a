"""Regional ``torch.compile`` of the policy's decoder layers, with the compiled code cached on disk.

Each decoder layer's ``forward`` is compiled on its own (the layers share their code, so one graph serves
them all) with dynamic shapes, since packed micro-batches change length every step. The attention of a packed
row (``rlfleet.policy.packed_attention``) reads the sequence boundaries from the position ids, a graph break:
the parts before and after it compile, and the elementwise work around the matmuls (norms, rotary
embeddings, activations, residual adds, dtype casts) fuses into a few kernels. Compiled before activation
checkpointing wraps the layers and before FSDP2 shards them, so its hooks stay outside the compiled code.
The token logprobs over the vocabulary (``rlfleet.policy.logprobs.picked_logprobs``: a float32 cast, a
log-sum-exp and a gather per position) compile too, for every model so marked.

Inductor's caches (FX graphs and AOT autograd) go under rlfleet's cache directory unless
``TORCHINDUCTOR_CACHE_DIR`` says otherwise: a second run with the same model and settings loads the
compiled kernels instead of building them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from rlfleet.policy.logprobs import COMPILED_MARK
from rlfleet.policy.parallelize import decoder_layers
from rlfleet.utils.cache import cache_root

CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def compile_cache_dir() -> Path:
    """Where inductor keeps compiled code: ``$TORCHINDUCTOR_CACHE_DIR`` when it names a directory of the
    user's, else rlfleet's cache/inductor. (Importing transformers makes torch set the variable to its own
    default, ``/tmp/torchinductor_<user>``, which a reboot empties: that one is replaced.)"""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get(CACHE_ENV)
    if current and Path(current).resolve() != Path(default_cache_dir()).resolve():
        return Path(current)
    return cache_root() / "inductor"


def compile_layers(model: PreTrainedModel) -> PreTrainedModel:
    """Compiles each decoder layer's ``forward`` (dynamic shapes), in place; points inductor's cache at
    ``compile_cache_dir`` for this process.

    Raises:
        ValueError: No decoder layers where ``decoder_layers`` looks; nothing changed.
    """
    layers = decoder_layers(model)
    os.environ[CACHE_ENV] = str(compile_cache_dir())  # inductor reads it at every compile
    for layer in layers:
        layer.forward = _compiled_without_cache(layer.forward)
    setattr(model, COMPILED_MARK, True)  # its logprobs compile too (rlfleet.policy.logprobs.default_pick)
    return model


def _compiled_without_cache(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` compiled, for the passes without a KV cache (training and logprobs); a call with
    ``past_key_values`` (HF generation on the policy's own module) runs it eagerly: the cache's state
    changes at every decoding step and would recompile the layer each time."""
    compiled = torch.compile(forward, dynamic=True)

    def layer_forward(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("past_key_values") is not None:
            return forward(*args, **kwargs)
        return compiled(*args, **kwargs)

    return layer_forward


def compile_seconds() -> float:
    """Seconds this process has spent compiling (dynamo, AOT autograd and inductor, forward and backward
    graphs, cache hits included); 0.0 before anything compiled."""
    from torch._dynamo.utils import calculate_time_spent  # the one place torch reports it

    return float(calculate_time_spent().get("total_wall_time", 0.0))
