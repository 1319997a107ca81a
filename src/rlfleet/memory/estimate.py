"""Peak memory of a training rank's logprob and training passes, from the model's shape alone.

Pure arithmetic over ``policy.architecture`` and the micro-batch token budget, so ``rlfleet plan`` and
``rlfleet validate`` can size a layout before any model is loaded. What a training rank holds at the peak
of a pass (Hugging Face's Llama-style decoder, SDPA attention, rlfleet's policy worker):

- **model state**: float32 master weights, float32 AdamW moments of the trained parameters, the frozen
  reference copy in the compute dtype when the loss needs one; all sharded over the training ranks;
- **bf16 compute copies**: under ``torch.autocast`` (one process) every weight's cast stays cached for the
  forward and backward (2 bytes a parameter); FSDP2 casts a layer at a time instead;
- **activations**: what autograd saves for the backward, per decoder layer and token, counted op by op
  below (``layer_activation_bytes``); with activation checkpointing only each layer's float32 input is kept
  and one layer's activations are recomputed at a time;
- **logits**: ``[tokens x vocabulary]`` logits in the compute dtype, their float32 copy and, in training,
  its gradients; with ``policy.logprob_chunk_size`` only one chunk of tokens at a time;
- **gradients** (float32, trained parameters) at the end of the backward and the optimizer step; the output
  layer's (``vocabulary x hidden``, tied to the embedding or not) from the start of the backward, beside the
  logits and the activations (a model whose vocabulary is most of its parameters, Gemma 3's 262k tokens,
  peaks there);
- on a CPU, the process itself (Python, PyTorch, transformers, tokenizer) and what glibc's heap keeps
  resident of the blocks a backward frees (a share of the layer activations it allocated,
  ``CPU_HEAP_RETENTION``), so the CPU estimate is of resident memory, the GPU one of
  ``torch.cuda.max_memory_allocated``.

The per-token constants were counted with ``saved_tensors_hooks`` on transformers' Llama and checked
against the peak of live tensors and the peak resident memory of SmolLM2-135M training passes
(``benchmarks/memory.py`` prints both); ``tests/unit/test_memory_estimate.py`` holds the tensor part to a
tiny model's measured peak.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlfleet.config.schema import ArchitectureConfig

GIB = 1024**3


def gib(n: float) -> str:
    """``n`` bytes as ``"3.0 GiB"``."""
    return f"{n / GIB:.1f} GiB"


# bytes per logit element at the peak of a pass, measured on SmolLM2 (benchmarks/memory.py): the logprob
# pass keeps the compute-dtype logits, a float32 copy and logsumexp's float32 temporary; the training pass
# also holds the float32 softmax gradient, the scattered target gradient and their cast
LOGIT_BYTES = {"logprob": 10.0, "train": 15.6}
# resident memory of the trainer process beside its tensors on a CPU (interpreter, PyTorch, transformers,
# tokenizer, data), as measured for SmolLM2 (benchmarks/memory.py)
CPU_PROCESS_BYTES = int(0.8 * GIB)
# glibc keeps freed heap blocks resident; during a backward on a CPU the heap grew by about this share of
# the layer activations the pass allocated (SmolLM2 in both precisions, with and without checkpointing).
# Blocks from glibc's largest mmap threshold up are mapped and unmapped on their own: never retained.
CPU_HEAP_RETENTION = 0.3
MMAP_THRESHOLD_MAX = 32 * 1024**2


@dataclass(frozen=True)
class PassShape:
    """One pass of one training rank.

    Attributes:
        tokens: Tokens of its largest micro-batch (padding included).
        logit_tokens: Tokens whose logits exist at once (``logprob_chunk_size``, or ``tokens``).
        compute_bytes: 2 for bfloat16/float16 compute, 4 for float32.
        checkpointing: Activation checkpointing of the decoder layers.
        tensor_parallel: The training tensor-parallel size (shards the heads and the MLP; the output layer,
            and so the logits, stay whole on every rank: ``rlfleet.policy.parallelize``'s plan).
    """

    tokens: int
    logit_tokens: int
    compute_bytes: int
    checkpointing: bool
    tensor_parallel: int = 1


@dataclass(frozen=True)
class ModelState:
    """Bytes of model state one training rank holds (already sharded)."""

    weights: float
    optimizer: float
    gradients: float
    reference: float
    compute_copies: float
    teacher: float = 0.0  # distillation: the frozen teacher's weights, in the same process


def head_dim(a: ArchitectureConfig) -> int:
    return a.head_dim or a.hidden_size // a.num_attention_heads


def layer_activation_bytes(a: ArchitectureConfig, compute_bytes: int, tensor_parallel: int = 1) -> float:
    """Bytes one decoder layer saves for its backward per token.

    Counted with ``saved_tensors_hooks`` on transformers' Llama layer (exact for it): two RMSNorms
    (float32 input, normalised output, 1/rms: ``8h + 4`` each); SDPA's query, key, value, output and
    float32 logsumexp; the output projection's input; the gated MLP's gate, up, activation and product.
    Under autocast each projection also saves its own cast of its input (3 for q/k/v, 2 for gate/up);
    float32 shares the one normalised tensor. ``q``/``kv``/``i`` and the heads are split by tensor parallel.
    """
    h, heads, i = a.hidden_size, a.num_attention_heads, a.intermediate_size
    q, kv = heads * head_dim(a), a.num_key_value_heads * head_dim(a)
    if compute_bytes == 4:
        fixed, split = 20 * h, 12 * q + 8 * kv + 16 * i
    else:
        fixed, split = 24 * h, 6 * q + 4 * kv + 8 * i
    return fixed + 8 + (split + 4 * heads) / tensor_parallel


def layer_transient_bytes(a: ArchitectureConfig, compute_bytes: int, tensor_parallel: int = 1) -> float:
    """Bytes per token a decoder layer's forward without autograd holds at its peak (counted on tiny Llamas,
    the live-tensor test), beside the rotary embedding's float32 cos and sin: in the gated MLP, four
    hidden-width float32 tensors (the embeddings, the residual stream, the attention's sum, the normalised
    input) and three of the intermediate width in the compute dtype (the gate's activation, the up
    projection, their product); or in the attention, three of the hidden width, the query, key and value
    projections in the compute dtype, and the rotary embedding's float32 temporaries (its cos and sin are
    float32, so a rotated head is too: the query's three while it rotates, or the rotated query beside
    the key's three)."""
    h, c, tp = a.hidden_size, compute_bytes, tensor_parallel
    q, kv = a.num_attention_heads * head_dim(a) / tp, a.num_key_value_heads * head_dim(a) / tp
    mlp = 16 * h + c * 3 * a.intermediate_size / tp
    attention = 12 * h + c * (q + 2 * kv) + 4 * max(3 * q, q + 3 * kv)
    return 8 * head_dim(a) + max(mlp, attention)


def backward_transient_bytes(a: ArchitectureConfig, compute_bytes: int, tensor_parallel: int = 1) -> float:
    """Bytes per token a decoder layer's backward adds to what the layers saved: about two gradients of the
    intermediate width in the compute dtype (fitted on tiny Llamas, both precisions, with and without
    checkpointing: the training passes' estimates 0.86-1.11x their measured peaks)."""
    return 2 * compute_bytes * a.intermediate_size / tensor_parallel


def activation_bytes(a: ArchitectureConfig, shape: PassShape) -> float:
    """Saved activations of a training pass at the start of its backward (embeddings and final norm
    included); with checkpointing, only the layers' float32 inputs (each layer's activations are
    recomputed in its backward, after the logits are freed: ``layer_backward_bytes``)."""
    ends = 12 * a.hidden_size  # embedding output, final norm
    if shape.checkpointing:
        return shape.tokens * (a.num_hidden_layers * 4 * a.hidden_size + ends)
    per_layer = layer_activation_bytes(a, shape.compute_bytes, shape.tensor_parallel)
    return shape.tokens * (a.num_hidden_layers * per_layer + ends)


def layer_backward_bytes(a: ArchitectureConfig, shape: PassShape) -> float:
    """What a checkpointed layer's backward holds on top of ``activation_bytes``: the layer's recomputed
    activations and its backward's transients (without checkpointing, the transients alone)."""
    layer = (
        layer_activation_bytes(a, shape.compute_bytes, shape.tensor_parallel) if shape.checkpointing else 0
    )
    return shape.tokens * (layer + backward_transient_bytes(a, shape.compute_bytes, shape.tensor_parallel))


def logit_bytes(a: ArchitectureConfig, shape: PassShape, pass_: str) -> float:
    """Every rank computes the whole vocabulary's logits: the tensor-parallel plan leaves the output layer
    whole (``rlfleet rehearse`` measures it so)."""
    return shape.logit_tokens * a.vocab_size * LOGIT_BYTES[pass_]


def heap_retention_bytes(a: ArchitectureConfig, shape: PassShape) -> float:
    """What glibc keeps resident of the blocks a CPU backward frees: ``CPU_HEAP_RETENTION`` of the layer
    activations held in blocks under ``MMAP_THRESHOLD_MAX`` (tensors of the hidden width, of the
    intermediate width, of the attention's width; ``layer_activation_bytes`` split by width)."""
    h, c, tp, t = a.hidden_size, shape.compute_bytes, shape.tensor_parallel, shape.tokens
    q, kv, i = a.num_attention_heads * head_dim(a), a.num_key_value_heads * head_dim(a), a.intermediate_size
    if c == 4:  # (bytes per token of the layer, bytes per token of one such tensor)
        parts = [(20 * h, 4 * h), (16 * i / tp, 4 * i / tp), ((12 * q + 8 * kv) / tp, 4 * q / tp)]
    else:
        parts = [
            (16 * h, 4 * h),
            (8 * h, c * h),
            (8 * i / tp, c * i / tp),
            ((6 * q + 4 * kv) / tp, c * q / tp),
        ]
    small = sum(total for total, one in parts if t * one < MMAP_THRESHOLD_MAX)
    return CPU_HEAP_RETENTION * t * a.num_hidden_layers * small


def output_gradient_bytes(a: ArchitectureConfig, tensor_parallel: int = 1) -> float:
    """The float32 gradient of the output layer (``vocabulary x hidden``), whole on every tensor-parallel
    rank (the plan leaves the output layer whole; ``tensor_parallel`` is accepted for the callers)."""
    return 4.0 * a.vocab_size * a.hidden_size


def train_peak(
    a: ArchitectureConfig,
    state: ModelState,
    shape: PassShape,
    *,
    cpu: bool,
    allocator: str = "glibc",
    trains_output_layer: bool = True,
) -> dict[str, float]:
    """Bytes at the peak of a training pass, by part. The backward peaks either at its start, where the
    saved activations, the logits and the output layer's gradient are, or inside the decoder layers, once
    the logits are freed (the saved activations, a checkpointed layer's recomputed ones, the layer backward's
    transients, the output layer's gradient), or at its end, where all the gradients are: the largest of
    the three. On a CPU with the process, and the heap's retention under glibc's ``malloc`` (jemalloc, as
    ``rlfleet`` runs a training process where it is installed, reuses what the backward frees:
    ``rlfleet.memory.allocator``). ``trains_output_layer``: False under LoRA (the frozen output layer gets
    no gradient)."""
    held = {
        "weights (fp32)": state.weights,
        "AdamW moments (fp32)": state.optimizer,
        "reference copy": state.reference,
        "compute copies": state.compute_copies,
        "teacher weights": state.teacher,
    }
    head = output_gradient_bytes(a, shape.tensor_parallel) if trains_output_layer else 0.0
    saved, logits, layers = (
        activation_bytes(a, shape),
        logit_bytes(a, shape, "train"),
        layer_backward_bytes(a, shape),
    )
    # at the end of the backward the float32 gradients exist (AdamW's update adds less than they do: on
    # SmolLM2 the pass's peak with nothing else left was the gradients plus the casts)
    if saved + max(logits, layers) + head < state.gradients:
        held |= {"gradients": state.gradients}
    elif logits >= layers:
        held |= {"activations": saved, "logits": logits, "output-layer gradient": head}
    else:
        held |= {"activations": saved, "layer backward": layers, "output-layer gradient": head}
    if cpu:
        retained = heap_retention_bytes(a, shape) if allocator == "glibc" else 0.0
        held |= {"heap retention": retained, "process": CPU_PROCESS_BYTES}
    return {k: v for k, v in held.items() if v}


def logprob_peak(
    a: ArchitectureConfig, state: ModelState, shape: PassShape, *, cpu: bool
) -> dict[str, float]:
    """Bytes at the peak of a logprob pass (no autograd), by part: inside a decoder layer, or at the logits
    beside the final hidden states. That is the peak of live tensors (a GPU's); on a CPU the layers' freed
    pages stay resident while the logits are computed, so there the two add up (``benchmarks/memory.py``
    compares the estimate with the measured peak)."""
    held = {
        "weights (fp32)": state.weights,
        "AdamW moments (fp32)": state.optimizer,
        "reference copy": state.reference,
        "compute copies": state.compute_copies,
        "teacher weights": state.teacher,
    }
    layers = shape.tokens * layer_transient_bytes(a, shape.compute_bytes, shape.tensor_parallel)
    logits = logit_bytes(a, shape, "logprob")
    final = shape.tokens * 4 * a.hidden_size  # the final norm's float32 output
    if cpu:
        held |= {"activations": layers, "logits": logits, "process": CPU_PROCESS_BYTES}
    elif layers >= logits + final:
        held["activations"] = layers
    else:
        held |= {"final hidden states": final, "logits": logits}
    return {k: v for k, v in held.items() if v}
