"""Methods added to vLLM's engine worker (``LLM(worker_extension_cls=...)``), run inside the engine process.

This module is imported by vLLM's worker process, so it imports nothing from rlfleet but stays importable
on its own. The trainer writes its weights to safetensors files and calls ``reload_from_files`` through
``LLM.collective_rpc`` with their paths: tensors inside ``collective_rpc`` arguments arrive as Python lists,
and a plain ``model.load_weights`` after start fails on CPU (its kernels repack some weights, leaving
0-size parameters), whereas ``model_runner.reload_weights`` redoes that processing.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch


def _read(paths: Sequence[str]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for path in paths:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                yield name, f.get_tensor(name)


class WeightReloadExtension:
    """Mixed into vLLM's worker class; ``self.model_runner`` is the worker's."""

    def reload_from_files(self, paths: list[str]) -> int:
        """Loads every tensor of the safetensors files ``paths`` (checkpoint names); returns how many."""
        count = 0

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal count
            for item in _read(paths):
                count += 1
                yield item

        self.model_runner.reload_weights(weights_iterator=counted())  # type: ignore[attr-defined]
        return count
