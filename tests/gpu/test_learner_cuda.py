"""The fast learner on a CUDA GPU: the chunked head equals the full logits there too (under
the deterministic settings every worker runs with), master weights step through the fused
CUDA AdamW, an update under autocast and master weights reads the device once, and the phase
clock reports the allocator. Skipped without a GPU (conftest.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from rollout.algorithms.chunked_head import head_logprobs
from rollout.algorithms.losses import token_logprobs
from rollout.runtime.phases import PhaseClock
from rollout.runtime.precision import MasterWeightAdamW


@pytest.fixture(autouse=True)
def deterministic():
    """As rollout.runtime.determinism sets every worker up."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_chunked_head_equals_the_full_logits_on_cuda(dtype):
    generator = torch.Generator(device="cuda").manual_seed(0)
    m, h, v = 300, 64, 5000
    hidden = torch.randn(m, h, device="cuda", generator=generator).to(dtype).requires_grad_()
    weight = torch.randn(v, h, device="cuda", generator=generator).to(dtype).requires_grad_()
    tokens = torch.randint(0, v, (m,), device="cuda", generator=generator)
    rows = torch.arange(0, m, 2, device="cuda")
    logprobs, entropy = head_logprobs(
        hidden, weight, None, tokens, rows, temperature=0.7, chunk_size=37, entropy=True
    )
    logprobs.sum().backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    selected = torch.zeros(m, dtype=torch.bool, device="cuda")
    selected[rows] = True
    full = token_logprobs((hidden @ weight.t())[None], tokens[None], 0.7)[0] * selected
    full.sum().backward()
    tolerance = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(logprobs, full, **tolerance)
    torch.testing.assert_close(grads[0], hidden.grad, **tolerance)
    torch.testing.assert_close(grads[1], weight.grad, **tolerance)
    assert entropy.device.type == "cuda"


def test_master_weights_run_the_fused_cuda_adamw():
    model = torch.nn.Linear(64, 32).cuda().bfloat16()
    unfused = copy.deepcopy(model)
    options = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    fused_opt = MasterWeightAdamW(model.parameters(), fused=True, **options)
    plain_opt = MasterWeightAdamW(unfused.parameters(), fused=False, **options)
    for _ in range(3):
        for a, b in zip(model.parameters(), unfused.parameters(), strict=True):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        fused_opt.step()
        plain_opt.step()
    for a, b in zip(model.parameters(), unfused.parameters(), strict=True):
        torch.testing.assert_close(
            fused_opt.state[a]["master"], plain_opt.state[b]["master"], rtol=1e-6, atol=1e-6
        )
        assert fused_opt.state[a]["step"].device.type == "cuda"


def test_the_phase_clock_reports_the_allocator():
    clock = PhaseClock("cuda")
    with clock.phase("work"):
        torch.ones(1024, 1024, device="cuda").sum()
    metrics = clock.metrics()
    assert metrics["perf/work_s"] > 0
    assert metrics["perf/cuda_peak_gib"] > 0
    assert metrics["perf/cuda_alloc_retries"] == 0
