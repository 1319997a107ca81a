"""LoRA: low-rank adapters on the linear layers of a causal LM, and their merge into the base weights.

An adapted linear computes ``y = x W^T + b + s * (x A^T) B^T`` with ``A: [r, in]``, ``B: [out, r]`` and
``s = alpha / r`` (``B`` starts at zero, so a fresh adapter leaves the model's output unchanged). The merged
weight is ``W + s * B A``.

``LoRALinear`` subclasses ``nn.Linear`` and keeps its ``weight`` and ``bias``, so the base parameter names
do not change (``...q_proj.weight``); the adapters add ``...q_proj.lora_A.weight`` and
``...q_proj.lora_B.weight``, PEFT's names without its ``base_model.model.`` prefix. Adapters live inside
the decoder layers, so FSDP2 shards and gathers them with the layer they belong to.

Targets follow NeMo RL's ``policy.dtensor_cfg.lora_cfg``: every linear layer (``match_all_linear``) or
those ``target_modules`` names, minus ``exclude_modules``. A pattern matches a module whose full name
equals it or ends with ``.<pattern>`` (``q_proj``), or, with ``*`` wildcards, the whole full name
(``model.layers.0.*``). A linear whose weight is tied to another module (``lm_head`` with
``tie_word_embeddings``) is never adapted: merging into it would change the embedding too.
"""

from __future__ import annotations

import fnmatch
import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from rlfleet.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from rlfleet.config.schema import MasterConfig

log = logging.getLogger(__name__)


class LoraTargetError(UserError, ValueError):
    """``lora_cfg`` names modules the model does not have, or none at all."""


@dataclass(frozen=True)
class LoraSettings:
    """``policy.dtensor_cfg.lora_cfg`` as the model builder takes it.

    Attributes:
        dim: The rank r of ``A`` and ``B``.
        alpha: Scale numerator: the adapter output is multiplied by ``alpha / dim``.
        dropout: Dropout probability on the adapter path (training only).
        dropout_position: ``pre``: on the adapter's input; ``post``: on its output.
        lora_A_init: ``xavier`` (normal) or ``uniform`` (Kaiming uniform, a=sqrt(5)); ``B`` starts at zero.
        target_modules: Patterns of the linears to adapt (with ``match_all_linear`` false).
        exclude_modules: Patterns of linears never adapted.
        match_all_linear: Adapt every linear layer (except tied ones and ``exclude_modules``).
    """

    dim: int
    alpha: float
    dropout: float = 0.0
    dropout_position: Literal["pre", "post"] = "post"
    lora_A_init: Literal["xavier", "uniform"] = "xavier"
    target_modules: tuple[str, ...] = ()
    exclude_modules: tuple[str, ...] = ()
    match_all_linear: bool = True

    @property
    def scaling(self) -> float:
        return self.alpha / self.dim


def matches(pattern: str, name: str) -> bool:
    """Whether ``pattern`` names the module ``name`` (full dotted path): equal, a dotted suffix, or a
    ``*`` wildcard over the whole name."""
    if "*" in pattern or "?" in pattern or "[" in pattern:
        return fnmatch.fnmatchcase(name, pattern)
    return name == pattern or name.endswith("." + pattern)


def select_targets(linears: Sequence[str], tied: set[str], settings: LoraSettings) -> list[str]:
    """The linears to adapt, in the given order; pure (names only).

    Args:
        linears: Full names of the model's ``nn.Linear`` modules.
        tied: Those whose weight is shared with another module (never adapted).
        settings: The targets, exclusions and ``match_all_linear``.

    Raises:
        LoraTargetError: A pattern matches no linear, a tied linear is named, or nothing is left to adapt.
    """
    candidates = sorted({name.rsplit(".", 1)[-1] for name in linears})
    unknown = [
        pattern
        for pattern in (*settings.target_modules, *settings.exclude_modules)
        if not any(matches(pattern, name) for name in linears)
    ]
    if unknown:
        raise LoraTargetError(
            f"policy.dtensor_cfg.lora_cfg: {unknown} match no linear layer of the model; linear layers "
            f"are named {candidates} (e.g. {linears[0] if linears else 'none'}); fix: use those names, a "
            "dotted suffix of a full name, or a '*' pattern over the full name"
        )
    if settings.match_all_linear:
        chosen = [name for name in linears if name not in tied]
        if tied:
            log.info("LoRA: not adapting %s (weights tied to another module)", sorted(tied))
    else:
        chosen = [name for name in linears if any(matches(p, name) for p in settings.target_modules)]
        named_tied = sorted(set(chosen) & tied)
        if named_tied:
            raise LoraTargetError(
                f"policy.dtensor_cfg.lora_cfg.target_modules selects {named_tied}, whose weight is tied to "
                "another module (tie_word_embeddings): merging an adapter into it for generation would also "
                "change the embedding; fix: leave it out of target_modules"
            )
    chosen = [name for name in chosen if not any(matches(p, name) for p in settings.exclude_modules)]
    if not chosen:
        raise LoraTargetError(
            "policy.dtensor_cfg.lora_cfg selects no linear layer to adapt (after exclude_modules); fix: "
            f"target_modules from {candidates}, or match_all_linear=true"
        )
    return chosen


class LoRALinear(nn.Linear):
    """A frozen ``nn.Linear`` plus a trainable low-rank update ``s * B A`` (float32 adapters).

    Build it with ``from_linear``, which reuses the base layer's parameters (no copy).
    """

    lora_A: nn.Linear
    lora_B: nn.Linear
    dropout: nn.Dropout
    dropout_position: Literal["pre", "post"]
    scaling: float
    adapters_enabled: bool

    @classmethod
    def from_linear(cls, base: nn.Linear, settings: LoraSettings) -> LoRALinear:
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.in_features, layer.out_features = base.in_features, base.out_features
        layer.weight = base.weight
        layer.bias = base.bias
        device = base.weight.device
        layer.lora_A = nn.Linear(
            base.in_features, settings.dim, bias=False, device=device, dtype=torch.float32
        )
        layer.lora_B = nn.Linear(
            settings.dim, base.out_features, bias=False, device=device, dtype=torch.float32
        )
        if settings.lora_A_init == "xavier":
            nn.init.xavier_normal_(layer.lora_A.weight)
        else:
            nn.init.kaiming_uniform_(layer.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(layer.lora_B.weight)
        layer.dropout = nn.Dropout(settings.dropout)
        layer.dropout_position = settings.dropout_position
        layer.scaling = settings.scaling
        layer.adapters_enabled = True
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        if not self.adapters_enabled:
            return out
        update: torch.Tensor
        if self.dropout_position == "pre":
            update = self.lora_B(self.lora_A(self.dropout(x)))
        else:
            update = self.dropout(self.lora_B(self.lora_A(x)))
        return out + update * self.scaling

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, r={self.lora_A.out_features}, scaling={self.scaling}"


def linear_modules(model: nn.Module) -> tuple[list[str], set[str]]:
    """Full names of ``model``'s ``nn.Linear`` modules, and those whose weight another module shares."""
    owners: dict[int, set[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(param), set()).add(name.rsplit(".", 1)[0])
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and name]
    tied = {name for name in linears if len(owners.get(id(model.get_submodule(name).weight), ())) > 1}
    return linears, tied


def apply_lora(model: nn.Module, settings: LoraSettings) -> list[str]:
    """Freezes ``model`` and replaces the selected linears by ``LoRALinear``; in place.

    Seed torch first: ``A`` is drawn at random (every rank of a mesh must draw the same).

    Returns:
        The adapted modules' full names.

    Raises:
        LoraTargetError: See ``select_targets``; nothing changed.
    """
    if has_adapters(model):
        raise ValueError("the model already has LoRA adapters")
    linears, tied = linear_modules(model)
    targets = select_targets(linears, tied, settings)
    model.requires_grad_(False)
    for name in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LoRALinear.from_linear(getattr(parent, child), settings))
    return targets


def lora_layers(model: nn.Module) -> list[LoRALinear]:
    return [m for m in model.modules() if isinstance(m, LoRALinear)]


def has_adapters(model: nn.Module) -> bool:
    return any(isinstance(m, LoRALinear) for m in model.modules())


def model_scaling(model: nn.Module) -> float:
    """The one ``alpha / dim`` of ``model``'s adapters."""
    scalings = {layer.scaling for layer in lora_layers(model)}
    if len(scalings) != 1:
        raise ValueError(f"expected one LoRA scaling in the model, found {sorted(scalings)}")
    return scalings.pop()


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Within the block ``model`` computes with its base weights only (adapters bypassed)."""
    layers = lora_layers(model)
    saved = [layer.adapters_enabled for layer in layers]
    for layer in layers:
        layer.adapters_enabled = False
    try:
        yield
    finally:
        for layer, enabled in zip(layers, saved, strict=True):
            layer.adapters_enabled = enabled


class WithoutAdapters:
    """The policy seen with its adapters off: the frozen reference of a LoRA run, with no second copy.

    Offers what the logprob code uses of a model (call, ``training``/``train``/``eval``, ``device``,
    ``config``); its train/eval mode is the policy's own.
    """

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with adapters_disabled(self.model):
            return self.model(*args, **kwargs)

    @property
    def training(self) -> bool:
        return self.model.training

    def train(self, mode: bool = True) -> WithoutAdapters:
        self.model.train(mode)
        return self

    def eval(self) -> WithoutAdapters:
        return self.train(False)

    @property
    def device(self) -> torch.device:
        return self.model.device

    def set_attn_implementation(self, attn_implementation: str) -> None:
        self.model.set_attn_implementation(attn_implementation)

    @property
    def config(self) -> Any:
        return self.model.config


# --------------------------------------------------------------------------------------------- state dicts


def _adapter_of(name: str) -> tuple[str, str] | None:
    """``(module prefix, "A" or "B")`` of an adapter key (prefix ``""`` or ending in ``.``), else None."""
    for which in ("A", "B"):
        suffix = f"lora_{which}.weight"
        if name == suffix or name.endswith("." + suffix):
            return name[: -len(suffix)], which
    return None


def is_adapter_key(name: str) -> bool:
    return _adapter_of(name) is not None


def merge_adapters(state: Mapping[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """A full state dict with every adapter folded into its base weight: ``W + scaling * B @ A``.

    Pure. The product and sum run in float32 (then cast back to ``W``'s dtype); the result has the base
    model's names only. A state dict without adapters comes back as a plain copy of the mapping.

    Raises:
        KeyError: An adapter without its partner.
    """
    merged = {name: value for name, value in state.items() if not is_adapter_key(name)}
    halves: dict[str, set[str]] = {}
    for name in state:
        found = _adapter_of(name)
        if found is not None:
            halves.setdefault(found[0], set()).add(found[1])
    lone = sorted(f"{prefix}lora_{''.join(h)}" for prefix, h in halves.items() if h != {"A", "B"})
    if lone:
        raise KeyError(f"LoRA adapters without their other half: {lone[:3]}")
    for prefix in halves:
        a, b, w = state[prefix + "lora_A.weight"], state[prefix + "lora_B.weight"], state[prefix + "weight"]
        delta = b.to(torch.float32) @ a.to(torch.float32)  # [out, r] @ [r, in]
        merged[prefix + "weight"] = (w.to(torch.float32) + scaling * delta).to(w.dtype)
    return merged


def adapter_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Only the adapter tensors of a state dict."""
    return {name: value for name, value in state.items() if is_adapter_key(name)}


# --------------------------------------------------------------------------------------------- counting


def linear_shapes(
    *, hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int, layers: int, vocab: int
) -> dict[str, tuple[int, int]]:
    """``{full name: (in, out)}`` of a Llama-style causal LM's linears (q/k/v/o, gate/up/down, lm_head)."""
    per_layer = {
        "self_attn.q_proj": (hidden, heads * head_dim),
        "self_attn.k_proj": (hidden, kv_heads * head_dim),
        "self_attn.v_proj": (hidden, kv_heads * head_dim),
        "self_attn.o_proj": (heads * head_dim, hidden),
        "mlp.gate_proj": (hidden, intermediate),
        "mlp.up_proj": (hidden, intermediate),
        "mlp.down_proj": (intermediate, hidden),
    }
    shapes = {f"model.layers.{i}.{name}": shape for i in range(layers) for name, shape in per_layer.items()}
    shapes["lm_head"] = (hidden, vocab)
    return shapes


def adapter_parameter_count(shapes: Mapping[str, tuple[int, int]], targets: Sequence[str], dim: int) -> int:
    """Parameters of the adapters on ``targets``: ``dim * (in + out)`` each."""
    return sum(dim * (shapes[name][0] + shapes[name][1]) for name in targets)


def lora_settings(cfg: MasterConfig) -> LoraSettings | None:
    """``policy.dtensor_cfg.lora_cfg`` for the model builder; None when LoRA is off."""
    lora = cfg.policy.dtensor_cfg.lora_cfg
    if not lora.enabled:
        return None
    return LoraSettings(
        dim=lora.dim,
        alpha=lora.alpha,
        dropout=lora.dropout,
        dropout_position=lora.dropout_position,
        lora_A_init=lora.lora_A_init,
        target_modules=tuple(lora.target_modules),
        exclude_modules=tuple(lora.exclude_modules),
        match_all_linear=lora.match_all_linear,
    )
