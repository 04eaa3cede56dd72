"""The static decode path on a CUDA GPU, with real CUDA graphs: what HfEngine takes on CUDA.

Captured steps sample what eager ones do, report what the learner recomputes, never sync with
the host inside a step, capture each (width, span, variant) once over a run of varied batch
sizes, see weights loaded in place and recapture when a parameter moves. Skipped where torch sees
no GPU (conftest.py); the CPU runs the same step eagerly in tests/unit/test_static_decode.py.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from rollout.engines.base import SamplingParams
from rollout.engines.hf.engine import HfEngine

DTYPES = ["bfloat16", "float32"]
LOGPROB_TOLERANCE = {"float32": 1e-4, "bfloat16": 0.1}
"""As tests/gpu/test_cuda.py: bfloat16 keeps 8 bits of mantissa."""

QUESTIONS = ("What is 2 + 3?", "Hi", "Compute 12 * 7 - 7, then explain.", "Name a color.")


def _load(dtype: str):
    from rollout.config.model import ModelSection
    from rollout.models.loading import load_model
    from rollout.planner.inspect_model import inspect_model

    section = ModelSection(builtin="tiny-llama")
    facts = inspect_model(section, base_dir=Path.cwd())
    return load_model(facts, section, dtype=dtype, device="cuda")


@pytest.fixture(scope="module", params=DTYPES)
def loaded(request, rollout_cache):
    return _load(request.param)


@pytest.fixture(scope="module")
def prompts(loaded) -> list[list[int]]:
    from rollout.models.loading import apply_chat_template

    return [apply_chat_template(loaded.tokenizer, loaded.chat_template, q, None) for q in QUESTIONS]


def make_engine(loaded, model=None, **overrides) -> HfEngine:
    arguments = {
        "eos_token_ids": loaded.eos_token_ids,
        "pad_token_id": loaded.pad_token_id,
        "tokenizer": loaded.tokenizer,
        "device": "cuda",
        "seed": 0,
    }
    return HfEngine(model if model is not None else loaded.model, **{**arguments, **overrides})


def _dtype(loaded) -> str:
    return str(loaded.model.dtype).removeprefix("torch.")


def learner_logprobs(model, prompts, completions, temperature: float) -> list[list[float]]:
    """One forward over prompt + completion, right-padded, no cache: log_softmax(logits / T)."""
    sequences = [prompts[c.prompt_index] + c.token_ids for c in completions]
    width = max(len(s) for s in sequences)
    input_ids = torch.zeros(len(sequences), width, dtype=torch.long, device="cuda")
    mask = torch.zeros(len(sequences), width, dtype=torch.long, device="cuda")
    for row, sequence in enumerate(sequences):
        input_ids[row, : len(sequence)] = torch.tensor(sequence, device="cuda")
        mask[row, : len(sequence)] = 1
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=mask).logits.float()
    logprobs = (logits / (temperature or 1.0)).log_softmax(-1)
    result = []
    for row, completion in enumerate(completions):
        start = len(prompts[completion.prompt_index])
        targets = torch.tensor(completion.token_ids, device="cuda")
        predicted = logprobs[row, start - 1 : start - 1 + len(targets)]
        result.append(predicted.gather(-1, targets[:, None]).squeeze(-1).tolist())
    return result


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=24, temperature=1.0, n=2, seed=1),
        SamplingParams(max_new_tokens=24, temperature=0.7, top_k=50, top_p=0.9, n=2, seed=2),
        SamplingParams(max_new_tokens=24, temperature=0.0, top_logprobs=3),
    ],
    ids=["t1.0", "truncated", "greedy-alternatives"],
)
def test_graphed_engine_matches_the_learner(loaded, prompts, params):
    engine = make_engine(loaded)
    completions = engine.generate(prompts, params)
    assert engine._static is not None, "CUDA takes the static path"
    assert engine.stats.extra["graph_captures"] >= 1
    expected = learner_logprobs(loaded.model, prompts, completions, params.temperature)
    for completion, learner in zip(completions, expected, strict=True):
        assert len(completion.token_ids) == params.max_new_tokens
        worst = max(abs(a - b) for a, b in zip(completion.logprobs, learner, strict=True))
        assert worst < LOGPROB_TOLERANCE[_dtype(loaded)], worst


def test_graphs_sample_what_eager_steps_and_the_dynamic_path_sample(loaded, prompts):
    params = SamplingParams(max_new_tokens=32, temperature=0.9, top_p=0.95, n=2, seed=3)
    graphed = make_engine(loaded).generate(prompts, params)
    eager = make_engine(loaded, cuda_graphs=False).generate(prompts, params)
    assert [c.token_ids for c in graphed] == [c.token_ids for c in eager]
    for mine, theirs in zip(graphed, eager, strict=True):
        assert mine.logprobs == pytest.approx(theirs.logprobs, abs=1e-5)
    if _dtype(loaded) == "float32":  # greedy tokens agree with DecodeBatch's (other kernels)
        greedy = SamplingParams(max_new_tokens=32, temperature=0.0)
        static = make_engine(loaded).generate(prompts, greedy)
        dynamic = make_engine(loaded, static=False).generate(prompts, greedy)
        assert [c.token_ids for c in static] == [c.token_ids for c in dynamic]


def test_a_step_never_syncs_with_the_host(loaded, prompts):
    for graphs in (True, False):
        engine = make_engine(loaded, cuda_graphs=graphs)
        engine.generate(prompts, SamplingParams(max_new_tokens=8, top_k=20, seed=0))  # warm
        decoder = engine._static
        with torch.inference_mode():
            decoder.decode(4, 64, truncating=True, alternatives=0)  # captured if not yet
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                for _ in range(4):
                    decoder.decode(4, 64, truncating=True, alternatives=0)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            decoder.ring_at.zero_()


def test_each_bucket_is_captured_once_over_varied_batch_sizes(loaded, prompts):
    engine = make_engine(loaded, max_batch_size=8)
    params = SamplingParams(max_new_tokens=20, temperature=1.0, seed=5)
    for count in (1, 3, 4, 2, 1, 4, 3):
        engine.generate(prompts[:count], replace(params, n=2))
    graphs = engine._static._graphs
    captures = engine.stats.extra["graph_captures"]
    assert captures == len(graphs), "a (width, span, variant) was captured twice"
    widths = {key[0] for key in graphs._graphs}
    assert widths <= {1, 2, 4, 8}
    again = captures
    for count in (4, 1, 2, 3):
        engine.generate(prompts[:count], replace(params, n=2))
    assert engine.stats.extra["graph_captures"] == again  # all replayed, none captured


def test_weights_loaded_in_place_replay_and_moved_weights_recapture(loaded, prompts):
    model = copy.deepcopy(loaded.model)
    engine = make_engine(loaded, model)
    greedy = SamplingParams(max_new_tokens=16, temperature=0.0)
    engine.generate(prompts, greedy)
    captures = engine.stats.extra["graph_captures"]
    with torch.no_grad():
        changed = {name: tensor * 1.25 for name, tensor in model.state_dict().items()}
    engine.load_weights(changed, version=1)
    got = engine.generate(prompts, greedy)
    fresh = make_engine(loaded, copy.deepcopy(model)).generate(prompts, greedy)
    assert [c.token_ids for c in got] == [c.token_ids for c in fresh]
    assert engine.stats.extra["graph_captures"] == captures  # same addresses: replayed

    projection = model.model.layers[0].mlp.down_proj
    projection.weight = torch.nn.Parameter(projection.weight.detach() * -1.0)
    got = engine.generate(prompts, greedy)
    fresh = make_engine(loaded, copy.deepcopy(model)).generate(prompts, greedy)
    assert [c.token_ids for c in got] == [c.token_ids for c in fresh]
    assert engine.stats.extra["graph_captures"] > captures  # moved: captured again


def test_the_service_streams_from_captured_steps(loaded, prompts):
    from rollout.engines.service import EngineService

    greedy = SamplingParams(max_new_tokens=24, temperature=0.0)
    expected = make_engine(loaded).generate(prompts, greedy)
    with EngineService(make_engine(loaded), max_batch_size=4) as service:
        handles = [service.submit(prompt, greedy) for prompt in prompts]
        results = [handle.result(timeout=120)[0] for handle in handles]
    assert [c.token_ids for c in results] == [c.token_ids for c in expected]
