"""model.precision: master weights keep updates that bfloat16 rounds away, each mode trains,
checkpoints carry the float32 copies so a resumed run is the uninterrupted one, fused and
unfused AdamW agree, and the plan refuses what makes no sense and counts what each mode holds."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from rollout.planner.memory import _trained_model_bytes
from rollout.runtime.checkpoint import load_checkpoint, save_checkpoint
from rollout.runtime.components import build_optimizer
from rollout.runtime.online.batches import RolloutBatch
from rollout.runtime.online.learner import Learner, LearnerKnobs
from rollout.runtime.precision import MasterWeightAdamW
from tests.unit.conftest import learner_knobs


def issues_of(raw: dict) -> dict:
    """Validate `raw`; {path: issue} of the ConfigError it must raise."""
    from rollout import ConfigError
    from rollout.config import validate_config

    with pytest.raises(ConfigError) as caught:
        validate_config(raw)
    return {issue.path: issue for issue in caught.value.issues}


def with_changes(base: dict, **sections: dict) -> dict:
    raw = copy.deepcopy(base)
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    return raw


def _algo(lr: float = 1e-2, weight_decay: float = 0.0) -> SimpleNamespace:
    return SimpleNamespace(lr=lr, adam_betas=(0.9, 0.999), adam_eps=1e-8, weight_decay=weight_decay)


def test_master_weights_keep_updates_below_bfloat16s_resolution():
    """lr 1e-4 on weights of 1.0: each AdamW step moves a weight by 1e-4, under half of
    bfloat16's spacing at 1.0 (2^-7 = 0.0078): plain bfloat16 AdamW never moves; the float32
    copy moves by 1e-4 a step, and the bfloat16 weight follows once the copy has moved far
    enough to round elsewhere."""
    master_param = torch.nn.Parameter(torch.ones(16, dtype=torch.bfloat16))
    plain_param = torch.nn.Parameter(torch.ones(16, dtype=torch.bfloat16))
    master = MasterWeightAdamW(
        [master_param], lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0
    )
    plain = torch.optim.AdamW([plain_param], lr=1e-4, weight_decay=0.0)
    for _ in range(100):
        for param in (master_param, plain_param):
            param.grad = torch.ones_like(param)
        master.step()
        plain.step()
    assert torch.equal(plain_param.detach(), torch.ones(16, dtype=torch.bfloat16))
    copy_ = master.state[master_param]["master"]
    assert copy_.dtype == torch.float32
    torch.testing.assert_close(copy_, torch.full((16,), 1 - 100 * 1e-4), rtol=0, atol=1e-5)
    torch.testing.assert_close(master_param.detach(), copy_.bfloat16())
    assert master_param[0].item() < 1.0


@pytest.mark.parametrize("precision", ["none", "master_weights"])
def test_fused_and_unfused_adamw_agree(precision):
    dtype = torch.bfloat16 if precision == "master_weights" else torch.float32
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8).to(dtype)
    results = []
    for fused in (False, True):
        trained = copy.deepcopy(model)
        optimizer = build_optimizer(trained, _algo(weight_decay=0.1), precision=precision)
        for group in optimizer.param_groups:
            group["fused"] = fused
        generator = torch.Generator(device="cpu").manual_seed(1)
        for _ in range(5):
            for param in trained.parameters():
                param.grad = torch.randn(param.shape, generator=generator).to(dtype)
            optimizer.step()
        results.append([p.detach().float() for p in trained.parameters()])
    for unfused, fused in zip(*results, strict=True):
        torch.testing.assert_close(fused, unfused, rtol=1e-6, atol=1e-6)


def _knobs(autocast_dtype: str | None) -> LearnerKnobs:
    return learner_knobs(
        micro_batch_size=4, max_grad_norm=1.0, max_new_tokens=6, autocast_dtype=autocast_dtype
    )


def _batch(tokenizer) -> RolloutBatch:
    """Two prompts, four fixed completions each; the first two of each group rewarded."""
    prompts = [tokenizer.encode("What is 2 + 3?"), tokenizer.encode("Hi")]
    completions = [[5 + i, 9, 11 + i] for i in range(8)]
    return RolloutBatch(
        prompt_ids=[prompts[i // 4] for i in range(8)],
        completion_ids=completions,
        old_logprobs=[[0.0] * 3 for _ in range(8)],
        rewards=torch.zeros(8),
        advantages=torch.tensor([1.0, 1.0, -1.0, -1.0] * 2),
        group_size=4,
        policy_version=0,
    )


MODES = {
    "none": ("float32", None),
    "autocast": ("float32", "bfloat16"),
    "master_weights": ("bfloat16", None),
}


@pytest.mark.parametrize("precision", list(MODES))
def test_each_mode_trains(tiny_llama, precision):
    """Rewarded completions gain probability, unrewarded ones lose it, step after step: the
    policy loss (advantage-weighted negative log-likelihood here) falls."""
    dtype, autocast_dtype = MODES[precision]
    model = copy.deepcopy(tiny_llama.model).to(getattr(torch, dtype))
    optimizer = build_optimizer(model, _algo(lr=3e-3), precision=precision)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    learner = Learner(
        model,
        optimizer,
        scheduler,
        _knobs(autocast_dtype),
        pad_token_id=tiny_llama.pad_token_id,
        device="cpu",
    )
    batch = _batch(tiny_llama.tokenizer)
    losses = []
    for _ in range(6):
        # On-policy each step: the batch's old log-probs are the current policy's.
        with torch.no_grad():
            from rollout.runtime.online.batches import pad_for_learner, unpad_left

            padded = pad_for_learner(batch, tiny_llama.pad_token_id, "cpu")
            current = learner.completion_logprobs(model, batch, padded)
        batch.old_logprobs = unpad_left(current, [3] * 8)
        sums = torch.tensor([sum(row) for row in batch.old_logprobs])
        losses.append(-(sums * batch.advantages).sum().item() / 8)
        learner.update(batch)
    assert losses[-1] < losses[0] - 0.1, losses
    assert all(p.dtype == getattr(torch, dtype) for p in model.parameters())


def test_a_checkpoint_restores_the_float32_copies_exactly(tiny_llama, tmp_path):
    """Three steps straight, against one step, a checkpoint, a fresh model and optimizer
    restored from it, and two more steps: the same bfloat16 weights and float32 copies."""
    algo = _algo(lr=1e-3, weight_decay=0.01)

    def fresh():
        model = copy.deepcopy(tiny_llama.model).to(torch.bfloat16)
        return model, build_optimizer(model, algo, precision="master_weights")

    def step(model, optimizer, seed):
        generator = torch.Generator(device="cpu").manual_seed(seed)
        for param in model.parameters():
            param.grad = torch.randn(param.shape, generator=generator).to(param.dtype)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    straight, straight_opt = fresh()
    for seed in range(3):
        step(straight, straight_opt, seed)

    first, first_opt = fresh()
    step(first, first_opt, 0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(first_opt, lambda _: 1.0)
    path = save_checkpoint(
        tmp_path,
        1,
        model=first,
        tokenizer=tiny_llama.tokenizer,
        optimizer=first_opt,
        scheduler=scheduler,
        trainer_state={},
        keep_last=1,
    )
    resumed, resumed_opt = fresh()
    load_checkpoint(path, model=resumed, optimizer=resumed_opt, scheduler=None)
    for seed in (1, 2):
        step(resumed, resumed_opt, seed)

    for a, b in zip(straight.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
        master_a, master_b = straight_opt.state[a]["master"], resumed_opt.state[b]["master"]
        assert master_b.dtype == torch.float32
        assert torch.equal(master_a, master_b)
        assert torch.equal(straight_opt.state[a]["exp_avg_sq"], resumed_opt.state[b]["exp_avg_sq"])


@pytest.mark.parametrize(
    "model, path",
    [
        ({"dtype": "float16"}, "model.dtype"),
        ({"dtype": "float16", "precision": "none"}, "model.dtype"),
        ({"dtype": "bfloat16", "precision": "autocast"}, "model.precision"),
        ({"dtype": "float32", "precision": "master_weights"}, "model.precision"),
    ],
)
def test_validate_refuses_precisions_that_make_no_sense(base_config, model, path):
    issues = issues_of(with_changes(base_config, model=model))
    assert path in issues
    assert issues[path].hint


@pytest.mark.parametrize(
    "dtype, precision",
    [
        ("auto", "auto"),
        ("float32", "none"),
        ("bfloat16", "none"),
        ("bfloat16", "master_weights"),
        ("auto", "master_weights"),
        ("float32", "autocast"),
        ("auto", "autocast"),
    ],
)
def test_sensible_precisions_validate(base_config, dtype, precision):
    from rollout.config import validate_config

    validate_config(with_changes(base_config, model={"dtype": dtype, "precision": precision}))


def test_the_plan_resolves_auto_and_counts_each_modes_memory(config_file, base_config):
    from rollout.planner.builder import build_plan
    from rollout.planner.definition import GpuFacts, HardwareFacts

    gib = 1024**3
    laptop = HardwareFacts(
        platform="test", cpu_count=8, memory_bytes=16 * gib, memory_available_bytes=12 * gib
    )
    h100 = laptop.model_copy(
        update={"gpus": [GpuFacts(index=0, name="H100", memory_bytes=80 * gib)]}
    )

    def derived(model, hardware=laptop):
        config = with_changes(base_config, model=model)
        return build_plan(config_file(config), hardware=hardware).derived

    assert (derived({}).dtype, derived({}).precision) == ("float32", "none")
    cuda = {"cluster": {"device": "cuda"}}
    on_gpu = build_plan(config_file(with_changes(base_config, **cuda)), hardware=h100).derived
    assert (on_gpu.dtype, on_gpu.precision) == ("bfloat16", "master_weights")
    master = derived({"precision": "master_weights"})
    assert (master.dtype, master.precision) == ("bfloat16", "master_weights")
    autocast = derived({"precision": "autocast"})
    assert (autocast.dtype, autocast.precision) == ("float32", "autocast")

    n = 1000
    assert _trained_model_bytes(n, 2, "master_weights", None) == {
        "weights": 2 * n,
        "gradients": 2 * n,
        "optimizer": 8 * n,
        "master_weights": 4 * n,
    }
    assert _trained_model_bytes(n, 2, "none", None)["optimizer"] == 4 * n  # bfloat16 moments
    assert _trained_model_bytes(n, 4, "autocast", None) == {
        "weights": 4 * n,
        "gradients": 4 * n,
        "optimizer": 8 * n,
        "autocast_weights": 2 * n,
    }
