"""Memory estimate per device, from model facts and the graph; fails a plan that cannot fit.

The estimate is deliberately simple and slightly pessimistic: weights, gradients and AdamW state
are exact byte counts; activations, logits and the KV cache use standard transformer formulas;
the runtime (Python, torch, CUDA context) is a fixed allowance. All CPU processes of a node share
one RAM budget; each GPU has its own.
"""

from __future__ import annotations

from collections import defaultdict

from rollout.config.root import RunConfig
from rollout.errors import Issue, PlanError
from rollout.plan.definition import Derived, Graph, HardwareFacts, MemoryEstimate, ModelFacts

GIB = 1024**3
BYTES_PER_PARAM = {"float32": 4, "bfloat16": 2, "float16": 2}
RUNTIME_BYTES = {"cpu": int(1.0 * GIB), "cuda": int(1.0 * GIB)}
HEADROOM = {"cpu": 0.90, "cuda": 0.95}
"""Share of a device's memory a plan may count on (the OS, allocator slack and fragmentation take
the rest)."""

# Activation bytes per token per layer, in units of hidden_size * bytes_per_value: the usual
# estimate for a transformer block without recomputation (attention and MLP intermediates).
_ACTIVATION_FACTOR = 34


def estimate_memory(
    config: RunConfig, model: ModelFacts, graph: Graph, derived: Derived, hardware: HardwareFacts
) -> list[MemoryEstimate]:
    per_device: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for process in graph.processes:
        if process.node != 0:  # every node has the same layout; node 0 stands for all
            continue
        device = "cpu" if graph.device == "cpu" else process.device
        items = per_device[device]
        items["runtime"] += RUNTIME_BYTES[graph.device]
        for name, size in _process_items(config, model, derived, process.roles).items():
            items[name] += size
        if "actor" in process.roles and config.generation.engine == "vllm":
            # vLLM takes a fixed share of the GPU for its weights and KV cache, whatever the batch.
            share = config.generation.gpu_memory_utilization
            items["vllm"] += int(_capacity(device, hardware) * share)
    return [
        _estimate(device, dict(items), _capacity(device, hardware))
        for device, items in sorted(per_device.items())
    ]


def check_fits(estimates: list[MemoryEstimate], *, source: str | None = None) -> None:
    issues = [_does_not_fit(e) for e in estimates if not e.fits]
    if issues:
        raise PlanError(issues, source=source)


def _process_items(
    config: RunConfig, model: ModelFacts, derived: Derived, roles: list[str]
) -> dict[str, int]:
    width = BYTES_PER_PARAM[derived.dtype]
    params = model.num_parameters
    items: dict[str, int] = defaultdict(int)
    trains = "learner" in roles
    if trains:
        items["weights"] += params * width
        items["gradients"] += params * width
        # AdamW keeps two fp32 moments, plus an fp32 master copy when training in half precision.
        items["optimizer"] += params * (8 if width == 4 else 12)
        items["activations"] += _activation_bytes(config, model, derived, width)
    if "actor" in roles and config.generation.engine == "hf":
        if not trains:  # a colocated hf actor generates with the learner's own weights
            items["weights"] += params * width
        items["kv_cache"] += _kv_cache_bytes(config, model, derived, width)
    if "reference" in roles:
        items["reference_weights"] += params * width
    if "critic" in roles:
        items["critic"] += params * (width * 2 + (8 if width == 4 else 12))
    return {k: v for k, v in items.items() if v}


def _activation_bytes(config: RunConfig, model: ModelFacts, derived: Derived, width: int) -> int:
    tokens = derived.micro_batch_size * derived.max_sequence_length
    layers = 1 if config.model.gradient_checkpointing else model.num_layers
    blocks = tokens * layers * model.hidden_size * _ACTIVATION_FACTOR * width // 2
    attention = (
        (derived.micro_batch_size * model.num_attention_heads * derived.max_sequence_length**2)
        * width
        * layers
    )
    # Logits and their log-softmax are kept in fp32 for a stable loss.
    logits = tokens * model.vocab_size * 4 * 2
    return blocks + attention + logits


def _kv_cache_bytes(config: RunConfig, model: ModelFacts, derived: Derived, width: int) -> int:
    batch = config.generation.max_batch_size or config.algorithm.rollout_batch_size
    context = config.generation.max_prompt_tokens + config.generation.max_new_tokens
    per_token = 2 * model.num_layers * model.num_kv_heads * model.head_dim * width
    sampling_logits = batch * model.vocab_size * 4
    return batch * context * per_token + sampling_logits


def _capacity(device: str, hardware: HardwareFacts) -> int:
    if device == "cpu":
        return hardware.memory_bytes
    index = int(device.split(":")[1])
    gpus = {gpu.index: gpu for gpu in hardware.gpus}
    return gpus[index].memory_bytes if index in gpus else 0


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


_REMEDIES = {
    "activations": "lower algorithm.micro_batch_size or set model.gradient_checkpointing = true",
    "kv_cache": "lower generation.max_batch_size or generation.max_new_tokens",
    "optimizer": 'use model.dtype = "bfloat16" or a smaller model',
    "weights": 'use model.dtype = "bfloat16" or a smaller model',
    "gradients": 'use model.dtype = "bfloat16" or a smaller model',
    "reference_weights": "set algorithm.kl_coef = 0 (no reference model) or place the reference "
    "role on another process",
    "critic": 'use algorithm.critic = "value_head" or place the critic on another process',
    "runtime": "run fewer processes per node (cluster.nproc_per_node)",
    "vllm": "lower generation.gpu_memory_utilization or place the actor on its own GPU",
}


def _does_not_fit(estimate: MemoryEstimate) -> Issue:
    kind = "cpu" if estimate.device == "cpu" else "cuda"
    usable = int(estimate.capacity_bytes * HEADROOM[kind])
    short = estimate.total_bytes - usable
    largest = sorted(estimate.items.items(), key=lambda kv: -kv[1])[:3]
    breakdown = ", ".join(f"{name} {gib(size)}" for name, size in largest)
    return Issue(
        "cluster",
        f"the plan needs {gib(estimate.total_bytes)} on {estimate.device} but can count on "
        f"{gib(usable)} ({HEADROOM[kind]:.0%} of {gib(estimate.capacity_bytes)}): short by "
        f"{gib(short)}; largest items: {breakdown}",
        hint=_REMEDIES.get(largest[0][0], "reduce batch sizes"),
    )


def gib(size: int) -> str:
    return f"{size / GIB:.2f} GiB"
