"""Every tensor the code that may meet CUDA tensors makes names its device.

A tensor made without a device lands on the CPU; met by a CUDA tensor it fails with "Expected all
tensors to be on the same device", but only on a GPU, which this suite does not have. Two checks
stand in for one:

- every call of a torch factory (torch.arange, zeros, full, tensor, Generator, ...) in the packages
  whose tensors can live on CUDA passes `device=` (the input's device, or "cpu" where the tensor is
  built on the host and moved once); `*_like` and `Tensor.new_*` take their input's device and
  pass;
- the hf engine's generate and the learner's log-prob pass, run under a TorchFunctionMode, call no
  factory from rollout code without a device: the first check read the source, this one sees what
  runs (through any alias).

Either fails on a factory without a device, as the shared-prefix prefill's torch.arange(shared)
did (CUDA runs of every online kind crashed at their first generation).
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

import rollout

ROOT = Path(rollout.__file__).parent
PACKAGES = ["engines", "runtime", "models", "algorithms", "harness", "inference", "serve"]
FACTORIES = {
    "arange",
    "as_tensor",
    "empty",
    "eye",
    "full",
    "linspace",
    "ones",
    "rand",
    "randint",
    "randn",
    "randperm",
    "tensor",
    "zeros",
}


def _factory_calls_without_device(path: Path, root: Path = ROOT) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        owner, name = node.func.value, node.func.attr
        if not (isinstance(owner, ast.Name) and owner.id == "torch"):
            continue
        named = any(keyword.arg == "device" for keyword in node.keywords)
        if name in FACTORIES and not named:
            found.append(f"{path.relative_to(root.parent)}:{node.lineno} torch.{name}")
        if name == "Generator" and not (named or node.args):
            found.append(f"{path.relative_to(root.parent)}:{node.lineno} torch.Generator")
    return sorted(found, key=lambda call: int(call.split(":")[1].split()[0]))


def test_every_factory_call_names_its_device() -> None:
    found = [
        call
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        for call in _factory_calls_without_device(path)
    ]
    assert not found, "torch factories without device= (pass the input's device):\n" + "\n".join(
        found
    )


def test_the_source_check_sees_a_factory_without_a_device(tmp_path: Path) -> None:
    source = tmp_path / "rollout" / "engines" / "bad.py"
    source.parent.mkdir(parents=True)
    source.write_text(
        "import torch\n"
        "def f(x):\n"
        "    return x + torch.arange(3)[None]\n"
        "def g(x):\n"
        "    return torch.zeros(3, device=x.device), x.new_zeros(3), torch.Generator(x.device)\n",
        encoding="utf-8",
    )
    found = _factory_calls_without_device(source, tmp_path / "rollout")
    assert found == ["rollout/engines/bad.py:3 torch.arange"]


# --- what runs -----------------------------------------------------------------------------------


class _FactoryRecorder(TorchFunctionMode):
    """Notes each factory called from rollout code without `device=` (file:line name)."""

    def __init__(self) -> None:
        super().__init__()
        self.factories = {getattr(torch, name) for name in FACTORIES}
        self.found: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.factories and "device" not in kwargs:
            caller = inspect.currentframe().f_back  # type: ignore[union-attr]
            filename = caller.f_code.co_filename if caller else ""
            if filename.startswith(str(ROOT)):
                self.found.append(f"{filename}:{caller.f_lineno} {func.__name__}")
        return func(*args, **kwargs)


def test_the_recorder_sees_a_factory_without_a_device() -> None:
    recorder = _FactoryRecorder()
    code = compile("torch.arange(3)", str(ROOT / "engines" / "made_up.py"), "eval")
    with recorder:
        eval(code, {"torch": torch})  # a frame whose file lies under rollout/
        torch.arange(3)  # this file is not rollout code
    assert recorder.found == [f"{ROOT / 'engines' / 'made_up.py'}:1 arange"]


def test_generate_and_the_learner_name_every_device(tiny_llama) -> None:
    """Generation with a shared prefix (prefilled once), refills and per-row sampling, then a
    learner update through the shared-prefix pass and the plain padded one."""
    import copy

    from rollout.engines.base import SamplingParams
    from rollout.engines.hf.engine import HfEngine
    from rollout.runtime.online.batches import RolloutBatch
    from rollout.runtime.online.learner import Learner, LearnerKnobs

    model = copy.deepcopy(tiny_llama.model)
    engine = HfEngine(
        model,
        eos_token_ids=tiny_llama.eos_token_ids,
        pad_token_id=tiny_llama.pad_token_id,
        tokenizer=tiny_llama.tokenizer,
        max_batch_size=2,
        device="cpu",
    )
    shared = tiny_llama.tokenizer.encode("You are a careful assistant. Answer briefly.")
    prompts = [shared + tiny_llama.tokenizer.encode(t) for t in ("2 + 3?", "Hi", "Why?")]
    knobs = LearnerKnobs(
        minibatch_size=3, micro_batch_size=3, update_epochs=1, clip_ratio_low=0.2,
        clip_ratio_high=0.2, kl_coef=0.0, kl_estimator="k3", loss_aggregation="token_mean",
        max_grad_norm=1.0, temperature=1.0, max_new_tokens=4,
    )  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    learner = Learner(
        model, optimizer, scheduler, knobs, pad_token_id=tiny_llama.pad_token_id, device="cpu"
    )
    recorder = _FactoryRecorder()
    with recorder:
        done = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=4, seed=3))
        rows = [
            row
            for index, prompt in enumerate(prompts)
            for row in engine.rows(
                prompt, SamplingParams(max_new_tokens=3, seed=index, top_k=5), prompt_index=index
            )
        ]
        batch = engine.decode_batch(2)  # 3 rows in 2 slots: the third is a refill
        batch.add(rows)
        while batch.busy:
            batch.step()
        # Completions of one prompt share it (the shared-prefix pass); then one per prompt.
        for group in (done, done[::2]):
            learner.update(
                RolloutBatch(
                    prompt_ids=[prompts[c.prompt_index] for c in group],
                    completion_ids=[c.token_ids for c in group],
                    old_logprobs=[c.logprobs for c in group],
                    rewards=torch.zeros(len(group), device="cpu"),
                    advantages=torch.linspace(-1, 1, len(group), device="cpu"),
                    group_size=2,
                    policy_version=0,
                )
            )
    assert not recorder.found, "factories called without device=:\n" + "\n".join(recorder.found)
