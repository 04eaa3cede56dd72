"""Memory estimate per device, from model facts and the graph; fails a plan that cannot fit.

The estimate is deliberately simple and slightly pessimistic: weights, gradients and AdamW state
are exact byte counts; activations, logits and the KV cache use standard transformer formulas;
the runtime (Python, torch, CUDA context) is a fixed allowance. All CPU processes of a node share
one RAM budget; each GPU has its own.

Generation is sized by `generation_shape`: how many sequences an actor process decodes at once
(generation.max_batch_size, else the larger of its share of the rollout batch and its share of
the evaluation prompts, which the hf engine also decodes in one chunk), for how many tokens
(max_prompt_tokens + max_new_tokens). Its KV cache is layers x 2 (keys and values) x kv_heads x
head_dim x dtype bytes per token, times batch x context. The hf engine on a float32 CPU model also
keeps a packed copy of its linear weights while it samples (see PACK_MAX_BYTES below).

A reference model is counted only where the runtime keeps one loaded (keeps_reference_model):
DPO, IPO and KTO with the default reference = "cached" hold none while they train.

With [model.lora] the learner trains the adapters alone (rollout.planner.lora counts them):
gradients and AdamW state are the adapters' (float32, as peft keeps them), their weights are
added to the model's, and a live reference is the policy with its adapters off, so no reference
copy is counted.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from rollout.config.algorithm import ONLINE_KINDS, REFERENCE_KINDS
from rollout.config.root import RunConfig
from rollout.errors import Issue, PlanError
from rollout.models.facts import ModelFacts
from rollout.planner.definition import (
    DataFacts,
    Derived,
    GpuFacts,
    Graph,
    HardwareFacts,
    MemoryEstimate,
)

GIB = 1024**3
BYTES_PER_PARAM = {"float32": 4, "bfloat16": 2, "float16": 2}
RUNTIME_BYTES = {"cpu": int(1.0 * GIB), "cuda": int(1.0 * GIB)}
HEADROOM = {"cpu": 0.90, "cuda": 0.95}
"""Share of a device's memory a plan may count on (the OS, allocator slack and fragmentation take
the rest)."""

# Activation bytes per token per layer, in units of hidden_size * bytes_per_value: the usual
# estimate for a transformer block without recomputation (attention and MLP intermediates).
_ACTIVATION_FACTOR = 34

# The hf engine's weight packing, duplicated here because the planner never imports the engine (it
# imports torch). The rule is rollout.engines.hf.packing.should_pack: a Llama-family model whose
# weights are float32 on the CPU, generating at least PACK_MIN_NEW_TOKENS tokens, and whose 2-D
# weights take at most PACK_MAX_BYTES, decodes through a packed GEMM (oneDNN's, else MKL's), with a
# packed copy of every linear layer (attention, MLP, and the head) alive while a chunk is sampled. A
# unit test checks these constants against the engine's.
PACK_MIN_NEW_TOKENS = 16
"""rollout.engines.hf.packing.PACK_MIN_NEW_TOKENS."""
PACK_MAX_BYTES = 2 * GIB
"""rollout.engines.hf.packing.PACK_MAX_BYTES: the largest 2-D weights (in bytes) the engine
packs."""
PACKED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2"})
"""model_types the engine decodes through its written-out (and packable) Llama step."""

# The chunked vocabulary head, duplicated here because the planner never imports torch: a unit
# test checks these against rollout.runtime.logprobs.CHUNKED_HEAD_MODEL_TYPES and
# rollout.algorithms.chunked_head.DEFAULT_CHUNK_BYTES.
CHUNKED_HEAD_MODEL_TYPES = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "phi3", "olmo", "olmo2", "smollm3", "gemma"}
)
"""rollout.runtime.logprobs.CHUNKED_HEAD_MODEL_TYPES."""
CHUNK_BYTES = 256 * 1024**2
"""rollout.algorithms.chunked_head.DEFAULT_CHUNK_BYTES: one chunk's float32 logits."""

# Per sequence, sampling keeps three float32 [vocab] rows: the logits, their exponentials and the
# running sum it draws from (rollout.engines.sampling.sample_tokens).
_SAMPLING_ROWS = 3


@dataclass(frozen=True)
class GenerationShape:
    """What one actor process generates at once, and the memory that takes."""

    engine: str
    batch: int
    """Sequences decoded at once by one actor process."""
    batch_reason: str
    """Where `batch` comes from, in words (for messages and `rollout plan --explain`)."""
    prompt_tokens: int
    new_tokens: int
    kv_bytes_per_token: int
    """2 (keys and values) x layers x kv_heads x head_dim x dtype bytes."""
    packed_weight_bytes: int
    """The hf engine's packed copy of the linear weights while it samples; 0 when it does not
    pack (or for vllm)."""
    sampling_bytes: int

    @property
    def context(self) -> int:
        return self.prompt_tokens + self.new_tokens

    @property
    def kv_cache_bytes(self) -> int:
        return self.batch * self.context * self.kv_bytes_per_token


def generation_shape(
    config: RunConfig,
    model: ModelFacts,
    graph: Graph,
    derived: Derived,
    data: Sequence[DataFacts] = (),
) -> GenerationShape | None:
    """The generation batch and its memory for one actor process; None if nothing generates."""
    if config.algorithm.kind not in ONLINE_KINDS:
        return None
    gen, algo = config.generation, config.algorithm
    actors = next((len(r.ranks) for r in graph.roles if r.role == "actor"), 1)
    rollout = max(1, algo.rollout_batch_size // actors)
    batch, reason = rollout, f"rollout batch {algo.rollout_batch_size} / {actors} actor process(es)"
    evaluation = next((f for f in data if f.split == "eval"), None)
    if evaluation is not None:
        # Evaluation samples each rank's share of the eval prompts (n = 1) in one generate call.
        per_rank = math.ceil(evaluation.num_records / graph.world_size)
        if per_rank > batch:
            batch = per_rank
            reason = f"{evaluation.num_records} eval prompts / {graph.world_size} process(es)"
    if gen.max_batch_size is not None and gen.max_batch_size < batch:
        batch, reason = gen.max_batch_size, "generation.max_batch_size"
    width = BYTES_PER_PARAM[derived.dtype]
    # An engine plugin is estimated as the hf engine it most likely wraps: the learner's model,
    # a KV cache of the batch's width, and (when it packs) packed weights.
    hf = gen.engine != "vllm"
    return GenerationShape(
        engine=gen.engine,
        batch=batch,
        batch_reason=reason,
        prompt_tokens=gen.max_prompt_tokens,
        new_tokens=gen.max_new_tokens,
        kv_bytes_per_token=kv_bytes_per_token(model, width),
        packed_weight_bytes=packed_weight_bytes(
            model, derived.dtype, graph.device, gen.max_new_tokens
        )
        if hf
        else 0,
        sampling_bytes=batch * model.vocab_size * 4 * _SAMPLING_ROWS if hf else 0,
    )


def kv_bytes_per_token(model: ModelFacts, width: int) -> int:
    """KV cache bytes per token: keys and values of every layer's kv heads."""
    return 2 * model.num_layers * model.num_kv_heads * model.head_dim * width


def packed_weight_bytes(model: ModelFacts, dtype: str, device: str, new_tokens: int) -> int:
    """Bytes of the hf engine's packed copy of the linear weights (0 when it does not pack)."""
    if not (
        device == "cpu"
        and dtype == "float32"
        and model.model_type in PACKED_MODEL_TYPES
        and new_tokens >= PACK_MIN_NEW_TOKENS
    ):
        return 0
    linear, head = _linear_weight_params(model)
    embedding = 0 if model.tie_word_embeddings else model.vocab_size * model.hidden_size
    two_d_bytes = (linear + head + embedding) * 4  # what should_pack weighs against the limit
    if two_d_bytes > PACK_MAX_BYTES:
        return 0
    return (linear + head) * 4  # the head is packed too, even when it shares the embedding


def _linear_weight_params(model: ModelFacts) -> tuple[int, int]:
    """Elements of the decoder layers' linear weights (q, k, v, o, gate, up, down) and of the
    head, from the architecture (biases and norms are 1-D and not packed)."""
    hidden, attention = model.hidden_size, model.num_attention_heads * model.head_dim
    kv = model.num_kv_heads * model.head_dim
    per_layer = 2 * hidden * attention + 2 * hidden * kv + 3 * hidden * model.intermediate_size
    return model.num_layers * per_layer, model.vocab_size * hidden


def runs_live_reference(config: RunConfig) -> bool:
    """Whether a reference model scores batches through training: the online kinds with a KL
    term (kl_coef > 0), and DPO, IPO and KTO with reference = "live"."""
    algo = config.algorithm
    if algo.kind in ONLINE_KINDS:
        return algo.kl_coef > 0
    return algo.kind in REFERENCE_KINDS and algo.reference == "live"


def keeps_reference_model(config: RunConfig) -> bool:
    """Whether a frozen copy of the policy stays loaded beside it through training: a live
    reference (runs_live_reference), unless LoRA trains adapters, whose base model, run with
    the adapters off, is the reference.

    With reference = "cached", the reference log-probs are computed once before step 1 by the
    policy itself (it is the reference until its first update), under no_grad, one micro batch
    at a time, before the optimizer exists: that pass holds the weights and one micro batch's
    forward pass, a part of what training then holds, so it never sets the peak.
    """
    return runs_live_reference(config) and config.model.lora is None


def estimate_memory(
    config: RunConfig,
    model: ModelFacts,
    graph: Graph,
    derived: Derived,
    hardware: HardwareFacts,
    shape: GenerationShape | None = None,
) -> list[MemoryEstimate]:
    """Bytes by item for each device. `shape` is generation_shape's answer (None: no actor)."""
    per_device: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for process in graph.processes:
        if process.node != 0:  # every node has the same layout; node 0 stands for all
            continue
        device = "cpu" if graph.device == "cpu" else process.device
        items = per_device[device]
        items["runtime"] += RUNTIME_BYTES[graph.device]
        shards = _fsdp_shards(config, graph)
        items_here = _process_items(config, model, derived, process.roles, shape, shards)
        for name, size in items_here.items():
            items[name] += size
        if "actor" in process.roles and config.generation.engine == "vllm":
            # vLLM takes a fixed share of the GPU for its weights and KV cache, whatever the batch.
            share = config.generation.gpu_memory_utilization
            items["vllm"] += int(_capacity(device, hardware) * share)
    return [
        _estimate(device, dict(items), _room(device, hardware))
        for device, items in sorted(per_device.items())
    ]


def check_fits(
    estimates: list[MemoryEstimate],
    *,
    source: str | None = None,
    shape: GenerationShape | None = None,
    extra: Iterable[Issue] = (),
) -> None:
    """Raise PlanError for every device whose estimate exceeds what it can count on (and for the
    `extra` issues, e.g. vllm_share_issues)."""
    issues = [_does_not_fit(e, shape) for e in estimates if not e.fits]
    issues.extend(extra)
    if issues:
        raise PlanError(issues, source=source)


def vllm_share_issues(
    config: RunConfig,
    model: ModelFacts,
    derived: Derived,
    hardware: HardwareFacts,
    graph: Graph,
    shape: GenerationShape | None,
) -> list[Issue]:
    """vLLM must hold the weights and at least one full-length sequence's KV cache in its share."""
    if shape is None or shape.engine != "vllm" or graph.device != "cuda":
        return []
    room = vllm_kv_room(config, model, derived, hardware, graph, shape)
    if room is None or room.sequences >= 1:
        return []
    gen = config.generation
    return [
        Issue(
            "generation.gpu_memory_utilization",
            f"vLLM's share {gen.gpu_memory_utilization:g} of {gib(room.capacity_bytes)} is "
            f"{gib(room.share_bytes)}, which cannot hold the weights ({gib(room.weight_bytes)}) "
            f"and the KV cache of one {shape.context}-token sequence "
            f"({size_text(shape.context * shape.kv_bytes_per_token)})",
            value=gen.gpu_memory_utilization,
            hint="raise generation.gpu_memory_utilization, or lower generation.max_prompt_tokens "
            "and generation.max_new_tokens",
        )
    ]


@dataclass(frozen=True)
class VllmRoom:
    capacity_bytes: int
    share_bytes: int
    weight_bytes: int
    sequences: int
    """Full-length sequences whose KV cache fits in the share beside the weights."""


def vllm_kv_room(
    config: RunConfig,
    model: ModelFacts,
    derived: Derived,
    hardware: HardwareFacts,
    graph: Graph,
    shape: GenerationShape,
) -> VllmRoom | None:
    """How many full-length sequences vLLM's share holds, on the first actor's GPU."""
    actor = next(
        (p for p in graph.processes if "actor" in p.roles and p.device.startswith("cuda")), None
    )
    if actor is None:
        return None
    capacity = _capacity(actor.device, hardware)
    share = int(capacity * config.generation.gpu_memory_utilization)
    weights = model.num_parameters * BYTES_PER_PARAM[derived.dtype]
    per_sequence = shape.context * shape.kv_bytes_per_token
    return VllmRoom(capacity, share, weights, max(0, share - weights) // per_sequence)


def _process_items(
    config: RunConfig,
    model: ModelFacts,
    derived: Derived,
    roles: list[str],
    shape: GenerationShape | None,
    shards: int = 1,
) -> dict[str, int]:
    width = BYTES_PER_PARAM[derived.dtype]
    params = model.num_parameters
    lora_adapters = (derived.adapter_parameters or 0) if config.model.lora is not None else None
    items: dict[str, int] = defaultdict(int)
    trains = "learner" in roles
    if trains:
        trained = _trained_model_bytes(params, width, derived.precision, lora_adapters)
        if shards > 1:
            trained = _sharded(trained, config, model, width, shards)
        for name, size in trained.items():
            items[name] += size
        items["activations"] += _activation_bytes(config, model, derived, width)
    if "actor" in roles and shape is not None and shape.engine != "vllm":  # hf or a plugin
        if not trains:  # a colocated hf actor generates with the learner's own weights
            items["weights"] += params * width
        items["kv_cache"] += shape.kv_cache_bytes
        items["sampling"] += shape.sampling_bytes
        items["packed_weights"] += shape.packed_weight_bytes
    if "reference" in roles and keeps_reference_model(config):
        items["reference_weights"] += params * width
    if "critic" in roles:
        # A copy of the trunk, trained whole, or with LoRA frozen under adapters of its own.
        critic = _trained_model_bytes(params, width, derived.precision, lora_adapters)
        items["critic"] += sum(critic.values())
    return {k: v for k, v in items.items() if v}


def _trained_model_bytes(
    params: int, width: int, precision: str, lora_adapters: int | None
) -> dict[str, int]:
    """What training a model of `params` parameters of `width` bytes holds, by item, under
    derived.precision (rollout.runtime.precision), with `lora_adapters` LoRA parameters when
    only they train."""
    if lora_adapters is not None:
        # The base is frozen; peft keeps the adapters in float32 whatever the model's dtype
        # (its autocast_adapter_dtype): their gradients and two moments are float32 too.
        items = {
            "weights": params * width,
            "adapter_weights": lora_adapters * 4,
            "gradients": lora_adapters * 4,
            "optimizer": lora_adapters * 8,
        }
        if precision == "autocast":
            items["autocast_weights"] = params * 2
        return items
    items = {"weights": params * width, "gradients": params * width}
    if precision == "master_weights":
        # float32 moments and the float32 copy of every weight, beside the low-precision ones.
        items["optimizer"] = params * 8
        items["master_weights"] = params * 4
    else:
        # torch's AdamW keeps its two moments in the parameters' dtype.
        items["optimizer"] = params * 2 * width
    if precision == "autocast":
        # Autocast caches a bfloat16 copy of each weight for the forward, and the backward
        # keeps it: the float32 weights plus half their size again.
        items["autocast_weights"] = params * 2
    return items


def _fsdp_shards(config: RunConfig, graph: Graph) -> int:
    """How many ranks the learner's state is sharded over (1: replicated)."""
    if config.cluster.sharding != "fsdp":
        return 1
    return sum(1 for p in graph.processes if "learner" in p.roles)


SHARDED_ITEMS = ("weights", "gradients", "optimizer", "master_weights")
"""What FSDP splits over its ranks (rollout.runtime.sharding); activations are each rank's own."""


def _sharded(
    trained: dict[str, int], config: RunConfig, model: ModelFacts, width: int, shards: int
) -> dict[str, int]:
    """`trained` with its sharded items divided over `shards` ranks, and the layers FSDP gathers
    whole while it computes: the one running and the one prefetched, in the compute dtype."""
    items = {
        name: math.ceil(size / shards) if name in SHARDED_ITEMS else size
        for name, size in trained.items()
    }
    mixed = config.cluster.fsdp_mixed_precision
    compute_width = BYTES_PER_PARAM[mixed.param_dtype] if mixed is not None else width
    reduce_width = BYTES_PER_PARAM[mixed.reduce_dtype] if mixed is not None else width
    per_layer = model.num_parameters // max(1, model.num_layers)
    items["unsharded_layers"] = 2 * per_layer * compute_width
    # A layer's whole gradient, in the reduction's dtype, goes into each reduce-scatter.
    items["reduce_buffers"] = per_layer * reduce_width
    return items


def _activation_bytes(config: RunConfig, model: ModelFacts, derived: Derived, width: int) -> int:
    tokens = derived.micro_batch_size * derived.max_sequence_length
    if derived.precision == "autocast":
        width = 2  # the forward's activations are bfloat16
    layers = 1 if config.model.gradient_checkpointing else model.num_layers
    blocks = tokens * layers * model.hidden_size * _ACTIVATION_FACTOR * width // 2
    attention = (
        (derived.micro_batch_size * model.num_attention_heads * derived.max_sequence_length**2)
        * width
        * layers
    )
    sharded = config.cluster.sharding == "fsdp"
    return blocks + attention + _logit_bytes(model, tokens, chunked=not sharded)


def _logit_bytes(model: ModelFacts, tokens: int, *, chunked: bool = True) -> int:
    """The vocabulary logits of a training step. The chunked head (rollout.runtime.logprobs)
    holds two float32 chunks at a time (the logits and their probabilities in the forward, the
    logits and their gradient, made in place, in the backward) and a float32 gradient of the
    head's weight; the full-logits route keeps the float32 logits and the copy autograd saves
    for the backward. A sharded model (`chunked` False) takes the full-logits route."""
    full = tokens * model.vocab_size * 4
    if not chunked or model.model_type not in CHUNKED_HEAD_MODEL_TYPES:
        return full * 2
    return min(full, CHUNK_BYTES) * 2 + model.vocab_size * model.hidden_size * 4


def _capacity(device: str, hardware: HardwareFacts) -> int:
    """The device's whole memory (what vLLM's gpu_memory_utilization is a share of)."""
    if device == "cpu":
        return hardware.memory_bytes
    gpu = _gpu(device, hardware)
    return gpu.memory_bytes if gpu else 0


def _room(device: str, hardware: HardwareFacts) -> int:
    """What a run can have of the device: a GPU's free memory when the probe read it (another
    process's tensors are not ours to use), else its whole memory."""
    gpu = None if device == "cpu" else _gpu(device, hardware)
    if gpu is not None and gpu.memory_free_bytes is not None:
        return gpu.memory_free_bytes
    return _capacity(device, hardware)


def _gpu(device: str, hardware: HardwareFacts) -> GpuFacts | None:
    index = int(device.split(":")[1])
    return next((gpu for gpu in hardware.gpus if gpu.index == index), None)


def _estimate(device: str, items: dict[str, int], capacity: int) -> MemoryEstimate:
    kind = "cpu" if device == "cpu" else "cuda"
    total = sum(items.values())
    return MemoryEstimate(
        device=device,
        capacity_bytes=capacity,
        items=dict(sorted(items.items())),
        total_bytes=total,
        fits=total <= capacity * HEADROOM[kind],
    )


_GENERATION_KNOBS = (
    "lower generation.max_batch_size, generation.max_new_tokens or generation.max_prompt_tokens"
)
_REMEDIES = {
    "activations": "lower algorithm.micro_batch_size or set model.gradient_checkpointing = true",
    "kv_cache": _GENERATION_KNOBS,
    "sampling": "lower generation.max_batch_size",
    "packed_weights": 'use model.dtype = "bfloat16" (the hf engine packs float32 weights only) '
    "or a smaller model",
    "optimizer": 'train LoRA adapters ([model.lora]), use model.dtype = "bfloat16" or a smaller '
    "model",
    "master_weights": 'use model.precision = "none" (bfloat16 updates then round away below a '
    "weight's resolution), train LoRA adapters ([model.lora]) or use a smaller model",
    "autocast_weights": 'use model.precision = "master_weights" (bfloat16 weights) or a smaller '
    "model",
    "weights": 'use model.dtype = "bfloat16" or a smaller model',
    "adapter_weights": "lower model.lora.rank or name fewer model.lora.target_modules",
    "gradients": 'train LoRA adapters ([model.lora]), use model.dtype = "bfloat16" or a smaller '
    "model",
    "reference_weights": 'use algorithm.reference = "cached" (DPO, IPO, KTO) or set '
    "algorithm.kl_coef = 0 (online kinds): no reference model is held then; or place the "
    "reference role on another process",
    "critic": 'use algorithm.critic = "value_head" or place the critic on another process',
    "runtime": "run fewer processes per node (cluster.nproc_per_node)",
    "vllm": "lower generation.gpu_memory_utilization or place the actor on its own GPU",
}


def _does_not_fit(estimate: MemoryEstimate, shape: GenerationShape | None) -> Issue:
    kind = "cpu" if estimate.device == "cpu" else "cuda"
    usable = int(estimate.capacity_bytes * HEADROOM[kind])
    short = estimate.total_bytes - usable
    largest = sorted(estimate.items.items(), key=lambda kv: -kv[1])[:3]
    breakdown = ", ".join(f"{name} {gib(size)}" for name, size in largest)
    # A GPU's capacity is what was free when planned (_room): say so, it may be busy.
    of = gib(estimate.capacity_bytes) + ("" if kind == "cpu" else " free")
    message = (
        f"the plan needs {gib(estimate.total_bytes)} on {estimate.device} but can count on "
        f"{gib(usable)} ({HEADROOM[kind]:.0%} of {of}): short by {gib(short)}; "
        f"largest items: {breakdown}"
    )
    hint = _REMEDIES.get(largest[0][0], "reduce batch sizes")
    if shape is not None and "kv_cache" in estimate.items:
        message += f"; {describe_kv_cache(shape)}"
        if largest[0][0] == "kv_cache":
            hint = (
                f"{_GENERATION_KNOBS} (now {shape.batch}, {shape.new_tokens} and "
                f"{shape.prompt_tokens}): the KV cache grows with each"
            )
    return Issue("cluster", message, hint=hint)


def describe_kv_cache(shape: GenerationShape) -> str:
    """The KV cache's size and where it comes from, in one line."""
    return (
        f"the KV cache holds {shape.batch} sequences ({shape.batch_reason}) x {shape.context} "
        f"tokens (max_prompt_tokens {shape.prompt_tokens} + max_new_tokens {shape.new_tokens}) x "
        f"{shape.kv_bytes_per_token} bytes per token = {size_text(shape.kv_cache_bytes)}"
    )


def gib(size: int) -> str:
    return f"{size / GIB:.2f} GiB"


def size_text(size: int) -> str:
    """GiB from a hundredth of one up, MiB below: small models' items stay readable."""
    return gib(size) if size >= GIB / 100 else f"{size / 1024**2:.1f} MiB"
