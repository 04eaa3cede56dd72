"""Render a Plan for people: what will run where, how much memory it takes, which code it calls."""

from __future__ import annotations

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from rollout.config.algorithm import ONLINE_KINDS, REFERENCE_KINDS
from rollout.planner.definition import FunctionRewardRecord, Plan, ToolSandbox
from rollout.planner.memory import (
    BYTES_PER_PARAM,
    GenerationShape,
    generation_shape,
    keeps_reference_model,
    size_text,
    vllm_kv_room,
)


def explain(plan: Plan, console: Console) -> None:
    console.print(_header(plan))
    console.print(_model_and_data(plan))
    console.print(_batches(plan))
    console.print(_graph(plan))
    console.print(_memory(plan))
    if plan.plugins:
        console.print(_plugins(plan))
    console.print(_environment(plan))


def _header(plan: Plan) -> Panel:
    config = plan.config
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column(overflow="fold")
    grid.add_row(
        "run", f"{plan.run_id}: {config.algorithm.kind} for {plan.derived.total_steps} steps"
    )
    grid.add_row("config", plan.config_path or "(in memory)")
    grid.add_row("run dir", plan.derived.run_dir)
    grid.add_row("store", plan.derived.store)
    grid.add_row(
        "checkpoints",
        f"{plan.derived.artifacts} (every {config.checkpoint.interval} steps, keep "
        f"{config.checkpoint.keep_last})",
    )
    return Panel(grid, title="rollout plan", title_align="left")


def _model_and_data(plan: Plan) -> Table:
    model = plan.model
    table = Table(title="Model and data", title_justify="left", show_header=False, box=None)
    table.add_column(style="bold")
    table.add_column()
    quant = f", {model.quantization} on disk" if model.quantization else ""
    origin = model.location
    if model.source == "hub" and model.commit is not None:
        # The snapshot directory is long; the id and commit say which model it is.
        origin = f"{plan.config.model.hub} at commit {model.commit[:12]} (Hugging Face cache)"
    table.add_row("model", f"{model.architecture} from {origin}")
    table.add_row(
        "",
        f"{model.num_parameters / 1e6:.1f}M params, {model.num_layers} layers, hidden "
        f"{model.hidden_size}, vocab {model.vocab_size}, context {model.context_length}, "
        f"{plan.derived.dtype}{quant}",
    )
    table.add_row("", "chat template: " + ("yes" if model.chat_template else "no"))
    lora = plan.config.model.lora
    if lora is not None and plan.derived.adapter_parameters is not None:
        trained = plan.derived.adapter_parameters
        targets = lora.target_modules
        table.add_row(
            "LoRA",
            f"rank {lora.rank}, alpha {lora.alpha:g}, dropout {lora.dropout:g} on "
            f"{targets if isinstance(targets, str) else ', '.join(targets)}: "
            f"{trained / 1e6:.2f}M trained params ({trained / model.num_parameters:.2%}); "
            f"checkpoints export the {lora.export} model",
        )
    for facts in plan.data:
        table.add_row(
            facts.split,
            f"{facts.location} ({facts.format}, {facts.num_records} records; fields: "
            f"{', '.join(facts.fields)})",
        )
    return table


def _batches(plan: Plan) -> Table:
    derived = plan.derived
    algo = plan.config.algorithm
    table = Table(title="Batches", title_justify="left", show_header=False, box=None)
    table.add_column(style="bold")
    table.add_column()
    if algo.kind in ONLINE_KINDS:
        gen = plan.config.generation
        table.add_row(
            "per step",
            f"{derived.prompts_per_step} prompts x {algo.num_generations} generations = "
            f"{algo.rollout_batch_size} completions, <= {gen.max_new_tokens} new tokens each",
        )
        table.add_row(
            "updates",
            f"{derived.optimizer_steps_per_step} optimizer step(s) per step: minibatch "
            f"{derived.minibatch_size}, micro batch {derived.micro_batch_size}, "
            f"{algo.update_epochs} epoch(s)",
        )
        shape = generation_shape(plan.config, plan.model, plan.graph, derived, plan.data)
        if shape is not None:
            for label, text in _generation_rows(plan, shape):
                table.add_row(label, text)
    else:
        table.add_row(
            "per step",
            f"{derived.minibatch_size} samples, micro batch {derived.micro_batch_size} "
            f"(x{derived.grad_accumulation} accumulation), max length {derived.max_sequence_length}",
        )
    table.add_row("lr", f"{algo.lr:g}, {algo.lr_schedule}, warmup {algo.warmup_steps}")
    return table


def _generation_rows(plan: Plan, shape: GenerationShape) -> list[tuple[str, str]]:
    """The engine, its batch limits, and the memory its batch takes."""
    gen, model = plan.config.generation, plan.model
    limit = gen.max_batch_size if gen.max_batch_size is not None else "none"
    rows = [
        (
            "engine",
            f"{gen.engine}: {shape.batch} sequences at once per actor process "
            f"({shape.batch_reason}; generation.max_batch_size {limit}), context {shape.context} "
            f"tokens ({shape.prompt_tokens} prompt + {shape.new_tokens} new)",
        ),
        (
            "kv cache",
            f"{size_text(shape.kv_cache_bytes)} = {shape.batch} sequences x {shape.context} "
            f"tokens x {shape.kv_bytes_per_token} bytes (2 x {model.num_layers} layers x "
            f"{model.num_kv_heads} kv heads x {model.head_dim} head dim x "
            f"{BYTES_PER_PARAM[plan.derived.dtype]} bytes)",
        ),
    ]
    if shape.packed_weight_bytes:
        rows.append(
            (
                "packed",
                f"{size_text(shape.packed_weight_bytes)}: the hf engine's packed copy of the "
                "linear weights while it samples (float32 on CPU)",
            )
        )
    if shape.engine == "vllm":
        room = vllm_kv_room(plan.config, plan.model, plan.derived, plan.hardware, plan.graph, shape)
        if room is not None:
            rows.append(
                (
                    "vllm",
                    f"share {gen.gpu_memory_utilization:g} = {size_text(room.share_bytes)}: "
                    f"weights {size_text(room.weight_bytes)}, KV room for about "
                    f"{room.sequences} sequences of {shape.context} tokens",
                )
            )
    return rows


def _graph(plan: Plan) -> Table:
    graph = plan.graph
    table = Table(
        title=f"Roles on {graph.world_size} process(es), {graph.nnodes} node(s), {graph.device}, "
        f"{graph.backend}",
        title_justify="left",
    )
    table.add_column("role", style="bold")
    table.add_column("ranks")
    table.add_column("devices")
    table.add_column("what it does")
    for role in graph.roles:
        table.add_row(
            role.role, ",".join(map(str, role.ranks)), _devices(plan, role.ranks), role.what
        )
    for edge in graph.edges:
        table.add_row(
            Text(f"{edge.source} -> {edge.target}", style="dim"),
            Text(edge.transport.replace("_", " "), style="dim"),
            "",
            Text(edge.kind.replace("_", " "), style="dim"),
        )
    return table


def _devices(plan: Plan, ranks: list[int]) -> str:
    """Where a role's ranks run: their devices, each named with its node on several nodes
    (node 1 cuda:0); one CPU for every rank on CPU."""
    graph = plan.graph
    if graph.device == "cpu":
        return "cpu"
    processes = [graph.processes[rank] for rank in ranks]
    if graph.nnodes == 1:
        return ",".join(p.device for p in processes)
    return ",".join(f"node {p.node} {p.device}" for p in processes)


def _memory(plan: Plan) -> Table | Group:
    """One column per device, one row per item: stays readable however many items there are."""
    table = Table(title="Memory estimate", title_justify="left")
    table.add_column("item", style="bold")
    for estimate in plan.memory:
        table.add_column(estimate.device, justify="right")
    items = sorted({name for estimate in plan.memory for name in estimate.items})
    for name in items:
        table.add_row(name.replace("_", " "), *(_gib(e.items.get(name, 0)) for e in plan.memory))
    table.add_row("[bold]total[/]", *(f"[bold]{_gib(e.total_bytes)}[/]" for e in plan.memory))
    table.add_row("capacity", *(_gib(e.capacity_bytes) for e in plan.memory))
    table.add_row("fits", *("[green]yes[/]" if e.fits else "[red]no[/]" for e in plan.memory))
    note = _reference_note(plan)
    return table if note is None else Group(table, Text(note))


def _reference_note(plan: Plan) -> str | None:
    """Where the reference log-probs come from, and so whether a reference model is counted."""
    if keeps_reference_model(plan.config):
        return "reference weights: a frozen copy of the initial policy, loaded through training"
    if plan.derived.reference_adapters_off:
        return (
            "reference: the policy with its LoRA adapters off (the base model it adapts); no "
            "copy is held"
        )
    if plan.config.algorithm.kind in REFERENCE_KINDS:
        return (
            "reference: log-probs computed once before step 1 by the policy itself and cached in "
            "the run directory; no reference model is held (that pass needs less than a step)"
        )
    return None


def _plugins(plan: Plan) -> Table:
    table = Table(title="Plugins", title_justify="left")
    table.add_column("used by", style="bold", no_wrap=True)
    table.add_column("reference", overflow="fold")
    table.add_column("resolved to", overflow="fold")
    table.add_column("identity", overflow="fold")
    table.add_column("runs in", overflow="fold")
    sidecars = _sidecars(plan)
    for plugin in plan.plugins:
        if plugin.distribution:
            identity = f"{plugin.distribution} {plugin.version}"
        else:
            identity = f"sha256 {plugin.sha256[:12] if plugin.sha256 else '?'}"
        runs_in = sidecars.get(plugin.used_by, "worker")
        table.add_row(
            plugin.used_by, plugin.ref, f"{plugin.module}:{plugin.qualname}", identity, runs_in
        )
    return table


def _sidecars(plan: Plan) -> dict[str, str]:
    """used_by -> "sidecar (its python)" for each plugin that runs in a sidecar."""
    found = {
        record.plugin.used_by: record.python
        for record in plan.rewards
        if isinstance(record, FunctionRewardRecord) and record.isolation == "sidecar"
    }
    env = plan.config.environment
    if plan.environment is not None and env is not None and env.isolation == "sidecar":
        found[plan.environment.used_by] = plan.environment_python
    return {used_by: f"sidecar ({python or 'this python'})" for used_by, python in found.items()}


def _environment(plan: Plan) -> Group:
    hw = plan.hardware
    gpus = (
        ", ".join(
            f"{g.name} ({_gib(g.memory_bytes)}"
            + ("" if g.memory_free_bytes is None else f", {_gib(g.memory_free_bytes)} free")
            + ")"
            for g in hw.gpus
        )
        or "none"
    )
    versions = plan.versions
    installed = [f"python {versions.python}", f"rollout {versions.rollout}"]
    installed += [
        f"{name} {getattr(versions, name)}"
        for name in ("torch", "transformers", "vllm")
        if getattr(versions, name)
    ]
    sandboxes = [("tools", "environment.allow_unsandboxed", plan.tool_sandbox)]
    sandboxes += [
        (f"reward {record.name!r}", f"rewards[{i}].allow_unsandboxed", record.sandbox)
        for i, record in enumerate(plan.rewards)
        if record.kind == "function"
    ]
    lines = [
        Text(f"sandbox   {_sandbox_state(sandbox)} for {runner}{_opt_out(sandbox, setting)}")
        for runner, setting, sandbox in sandboxes
        if sandbox is not None
    ]
    return Group(
        *lines,
        Text(f"hardware  {hw.cpu_count} CPU cores, {_gib(hw.memory_bytes)} RAM, GPUs: {gpus}"),
        Text(f"versions  {', '.join(installed)}"),
        Text(
            f"seeds     root {plan.seeds.root}, data {plan.seeds.data}, sampling "
            f"{plan.seeds.sampling}"
        ),
    )


def _sandbox_state(sandbox: ToolSandbox) -> str:
    return (
        "every capability works"
        if not sandbox.missing
        else "without: " + "; ".join(sandbox.missing)
    )


def _opt_out(sandbox: ToolSandbox, setting: str) -> str:
    return f" ({setting})" if sandbox.allow_unsandboxed else ""


def _gib(size: int) -> str:
    return size_text(size)
