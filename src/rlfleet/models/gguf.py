"""A GGUF file as a plain checkpoint: de-quantised once into rlfleet's cache, then loaded like any other.

transformers de-quantises a GGUF file at every load (its weights and its tokenizer, slow for a large
vocabulary), and each process of a run (the trainer, a reference copy,
Ray workers, ``rlfleet eval``) loads it again. :func:`converted_checkpoint` does it once per file: the
de-quantised float32 weights (safetensors), the config without its GGUF record (``drop_gguf_config``: vLLM
and ``from_pretrained`` read it as a plain model) and the tokenizer, in
``<cache>/converted/<file stem>-<key>``, the key naming the file's path, size and modification time. The
directory is written beside its final name and renamed there when complete, so concurrent first loads
(two Ray workers) each finish and one of them is kept.

**BOS and EOS as the model was trained.** A GGUF file records whether its tokenizer adds them
(``tokenizer.ggml.add_bos_token`` / ``add_eos_token``); transformers' conversion drops the record, and a
tokenizer built from Gemma 3's file adds no ``<bos>``, without which the model degenerates. The converted
tokenizer adds what the file says (:func:`token_flags`), so every path that encodes text (plain prompts,
SFT rows, the chat template's own ``bos_token``) gets the same ids.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PretrainedConfig

from rlfleet.models.packages import cache_dir

log = logging.getLogger(__name__)

# What transformers copies from a GGUF file into a model config beyond the architecture: the
# quantisation record (vLLM refuses ``quant_method: gguf``) and the file's ``general.name``.
GGUF_CONFIG_KEYS = ("quantization_config", "_model_name_or_path")
RECORD = "rlfleet-converted.json"
TOKEN_FLAG_KEYS = {
    "add_bos_token": "tokenizer.ggml.add_bos_token",
    "add_eos_token": "tokenizer.ggml.add_eos_token",
}


def drop_gguf_config(config: PretrainedConfig) -> PretrainedConfig:
    """Removes what a GGUF load leaves in ``config`` (see ``GGUF_CONFIG_KEYS``), in place.

    Dequantised weights are ordinary float tensors: the config saved with them (``save_pretrained``,
    ``rlfleet export``) must describe a plain model, one vLLM and ``from_pretrained`` load as such.
    """
    for key in GGUF_CONFIG_KEYS:
        if key in config.__dict__:
            delattr(config, key)
    return config


def token_flags(gguf_path: Path) -> dict[str, bool]:
    """``add_bos_token`` / ``add_eos_token`` as the GGUF file records them (only those it records)."""
    from gguf import GGUFReader  # transformers' GGUF loading needs it too

    fields = GGUFReader(str(gguf_path)).fields
    flags = {}
    for attribute, key in TOKEN_FLAG_KEYS.items():
        field = fields.get(key)
        if field is not None and field.data:
            flags[attribute] = bool(field.parts[field.data[0]][0])
    return flags


def conversion_key(gguf_path: Path) -> str:
    """Names one version of the file: its resolved path, size and modification time."""
    stat = gguf_path.stat()
    identity = f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    return hashlib.sha256(identity.encode()).hexdigest()[:16]


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """transformers draws a de-quantisation progress bar on stderr per GGUF load."""
    with open(os.devnull, "w") as sink, contextlib.redirect_stderr(sink):
        yield


def converted_checkpoint(directory: str, gguf_file: str) -> Path:
    """The plain checkpoint of ``directory/gguf_file`` (converted on first use; see the module docstring);
    ``directory`` may be a Hugging Face hub id, whose file comes through the hub's cache.

    Raises:
        FileNotFoundError: ``gguf_file`` is not in ``directory``.
    """
    source = Path(directory) / gguf_file
    if not Path(directory).is_dir():  # a hub id: the file from the hub (or its cache, offline)
        from huggingface_hub import hf_hub_download

        source = Path(hf_hub_download(directory, gguf_file))
    if not source.is_file():
        found = sorted(p.name for p in Path(directory).glob("*.gguf"))
        raise FileNotFoundError(
            f"policy.gguf_file={gguf_file!r} is not in {directory}; GGUF files there: {found or 'none'}"
        )
    target = cache_dir() / "converted" / f"{source.stem}-{conversion_key(source)}"
    if (target / RECORD).is_file():
        return target
    start = time.perf_counter()
    log.info("converting %s to a plain checkpoint in %s (once per file)", source, target)
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        _convert(source, partial)
        try:
            partial.rename(target)
        except OSError:  # another process finished it first: keep theirs
            if not (target / RECORD).is_file():
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    log.info("converted %s in %.1f s", source.name, time.perf_counter() - start)
    return target


def _convert(source: Path, out: Path) -> None:
    out.mkdir(parents=True)
    kwargs = {"gguf_file": source.name}
    with _quiet():
        tokenizer = AutoTokenizer.from_pretrained(str(source.parent), **kwargs)
        model = AutoModelForCausalLM.from_pretrained(str(source.parent), dtype=torch.float32, **kwargs)
    flags = token_flags(source)
    for attribute, value in flags.items():
        if getattr(tokenizer, attribute, None) != value:
            setattr(tokenizer, attribute, value)
    config = drop_gguf_config(model.config)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.generation_config = model.generation_config
    plain.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    record = {"source": str(source.resolve()), "size": source.stat().st_size, "token_flags": flags}
    (out / RECORD).write_text(json.dumps(record, indent=2) + "\n")
