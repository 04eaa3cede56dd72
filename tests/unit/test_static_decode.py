"""The static decode path (what CUDA devices take), run on the CPU without CUDA graphs, and with
a stand-in for them that runs what a capture runs: sampling on the device draws what the
distribution says, a row's random numbers follow it whatever batch it is in, finished slots are
refilled, buckets are chosen and captured once each, and the weights it reads follow the model.

The learner contract (log-probs, greedy tokens, eos, stop strings, top_logprobs) is tested for
this path with every other in test_hf_engine.py (its `engine` fixture runs both)."""

from __future__ import annotations

import copy
from typing import ClassVar

import pytest
import torch

from rollout.engines.base import SamplingParams
from rollout.engines.hf import static_batch, static_step
from rollout.engines.hf.engine import HfEngine, eval_mode
from rollout.engines.hf.static_step import round_capacity, span_bucket, supports_static
from rollout.engines.sampling import (
    counter_uniform,
    sample_rows,
    sample_rows_on_device,
    stream_key,
    truncate_rows,
)
from rollout.engines.service import EngineService
from rollout.models.loading import apply_chat_template

QUESTIONS = ("What is 2 + 3?", "Hi", "Compute 12 * 7 - 7, then explain the answer step by step.")


@pytest.fixture(scope="module")
def prompts(tiny_llama) -> list[list[int]]:
    return [
        apply_chat_template(tiny_llama.tokenizer, tiny_llama.chat_template, q, None)
        for q in QUESTIONS
    ]


def make_engine(loaded, model=None, **overrides) -> HfEngine:
    arguments = {
        "eos_token_ids": loaded.eos_token_ids,
        "pad_token_id": loaded.pad_token_id,
        "tokenizer": loaded.tokenizer,
        "seed": 0,
        "static": True,
    }
    return HfEngine(model if model is not None else loaded.model, **{**arguments, **overrides})


def greedy(max_new_tokens: int = 16, **kwargs) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, **kwargs)


def run_rows(engine: HfEngine, rows, max_width: int) -> None:
    batch = engine.decode_batch(max_width=max_width)
    with eval_mode(engine.model), torch.inference_mode():
        batch.add(rows)
        while batch.busy:
            batch.step()


# --- sampling on the device ----------------------------------------------------------------------

SETTINGS = [
    (0.0, 0, 1.0),
    (1.0, 0, 1.0),
    (0.7, 5, 1.0),
    (0.7, 0, 0.8),
    (1.3, 3, 0.5),
    (0.5, 1, 1.0),
]


def _settings() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    temperature, top_k, top_p = zip(*SETTINGS, strict=True)
    return (
        torch.tensor(temperature, device="cpu"),
        torch.tensor(top_k, device="cpu"),
        torch.tensor(top_p, device="cpu"),
    )


def test_on_device_sampling_without_truncation_is_sample_rows():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)) * 3
    temperature = torch.tensor([0.0, 1.0, 0.7, 1.3, 0.5, 2.0])
    off_k, off_p = torch.zeros(6, dtype=torch.long), torch.ones(6)
    uniform = torch.rand(6, generator=torch.Generator().manual_seed(1))
    expected = sample_rows(logits, temperature, off_k, off_p, uniform, top=3)
    got = sample_rows_on_device(logits, temperature, off_k, off_p, uniform, truncating=False, top=3)
    assert torch.equal(got.token_ids, expected.token_ids)
    assert torch.equal(got.logprobs, expected.logprobs)
    assert torch.equal(got.top.token_ids, expected.top.token_ids)


def test_on_device_truncated_sampling_draws_the_truncated_distribution():
    """A grid of N uniform draws per row lands on each token N times its probability (to
    within one draw per token): the distribution truncate_rows defines, exactly. Log-probs are
    the untruncated ones."""
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(2)) * 2
    temperature, top_k, top_p = _settings()
    draws = 4000
    grid = (torch.arange(draws) + 0.5) / draws
    # Every row with every draw of the grid, as one batch of 6 x N rows.
    sampled = sample_rows_on_device(
        logits.repeat_interleave(draws, 0),
        temperature.repeat_interleave(draws),
        top_k.repeat_interleave(draws),
        top_p.repeat_interleave(draws),
        grid.repeat(6),
        truncating=True,
    )
    token_ids = sampled.token_ids.view(6, draws)
    scaled = logits / torch.where(temperature > 0, temperature, 1.0)[:, None]
    untruncated = scaled.log_softmax(-1).gather(-1, token_ids)
    assert torch.allclose(sampled.logprobs.view(6, draws), untruncated, atol=1e-5)
    counts = torch.stack([torch.bincount(row, minlength=40) for row in token_ids]).float()
    probabilities = truncate_rows(scaled, top_k, top_p).softmax(-1)
    for row, (t, _, _) in enumerate(SETTINGS):
        if t == 0:  # greedy: always the most likely
            assert counts[row, logits[row].argmax()] == draws
            continue
        assert (counts[row] / draws - probabilities[row]).abs().max() <= 1.5 / draws
        assert (counts[row][probabilities[row] == 0] == 0).all()  # never a truncated token
    assert counts[5].count_nonzero() == 1  # top_k 1 is greedy


def test_counter_uniform_is_uniform_and_streams_are_independent():
    counter = torch.arange(1 << 16)
    draws = counter_uniform(torch.full_like(counter, stream_key(7, 0)), counter)
    assert draws.dtype == torch.float32 and draws.min() >= 0 and draws.max() < 1
    histogram = torch.histc(draws, bins=16, min=0, max=1)
    assert (histogram / (len(draws) / 16) - 1).abs().max() < 0.05
    other = counter_uniform(torch.full_like(counter, stream_key(7, 1)), counter)
    assert abs(torch.corrcoef(torch.stack((draws, other)))[0, 1]) < 0.02
    # Successive draws of one stream are not correlated either.
    assert abs(torch.corrcoef(torch.stack((draws[:-1], draws[1:])))[0, 1]) < 0.02
    keys = {stream_key(seed, sample) for seed in range(50) for sample in range(50)}
    assert len(keys) == 2500 and all(0 <= key < 2**63 for key in keys)
    # Elementwise: a row's draw does not depend on the rows beside it.
    rows = torch.tensor([stream_key(1, 0), stream_key(2, 5)])
    at = torch.tensor([3, 9])
    together = counter_uniform(rows, at)
    assert together[1] == counter_uniform(rows[1:], at[1:])[0]


# --- buckets -------------------------------------------------------------------------------------


def test_span_and_capacity_buckets():
    assert round_capacity(1) == 64 and round_capacity(64) == 64 and round_capacity(65) == 128
    assert span_bucket(5, 512) == 64
    assert span_bucket(65, 512) == 128 and span_bucket(128, 512) == 128
    assert span_bucket(300, 320) == 320  # never past the capacity


def test_width_buckets_follow_the_highest_slot_and_narrow_when_rows_finish(tiny_llama, prompts):
    engine = make_engine(tiny_llama)
    lengths = [10, 20, 12, 9, 30]  # rows finish one after another, none in the first round
    rows = [
        engine.rows(prompts[i % 3], greedy(n), prompt_index=i)[0] for i, n in enumerate(lengths)
    ]
    batch = engine.decode_batch(max_width=8)
    widths = []
    with torch.inference_mode():
        batch.add(rows)
        while batch.busy:
            batch.step()
            widths.append(batch.width)
    # 5 rows: bucket 8; then 4 left (4), 2 (2), 1 (1); never wider again.
    assert widths[0] == 8 and widths[-1] == 0
    assert [w for w in widths if w] == sorted((w for w in widths if w), reverse=True)
    assert {4, 2, 1} <= set(widths)
    assert engine.stats.extra["compactions"] >= 2
    for row, n in zip(rows, lengths, strict=True):
        (alone,) = make_engine(tiny_llama).generate([row.prompt], greedy(n))
        assert engine.completion(row).token_ids == alone.token_ids


# --- continuous batching in the slotted cache ----------------------------------------------------


def test_a_finished_slot_is_refilled_at_the_next_host_read(tiny_llama, prompts):
    reference = make_engine(tiny_llama).generate(prompts, greedy())
    eos = reference[0].token_ids[3]  # pretend the 4th token of prompt 0 ends a turn
    assert all(eos not in c.token_ids for c in reference[1:]), "pick another token"
    narrow = make_engine(tiny_llama, eos_token_ids=[eos], max_batch_size=2)
    completions = narrow.generate(prompts, greedy())
    assert [c.token_ids for c in completions] == [reference[0].token_ids[:4]] + [
        c.token_ids for c in reference[1:]
    ]
    for completion, full in zip(completions, reference, strict=True):
        assert completion.logprobs == pytest.approx(full.logprobs[: len(completion.logprobs)])
    # Rounds of 8 steps: prompt 0 ends in the first, prompt 2 takes its slot after it and
    # needs two more (16 tokens); one after the other would take 16 + 16 steps.
    assert narrow.stats.extra["decode_steps"] == 8 + 16
    assert narrow.stats.extra["host_reads"] == 3
    assert narrow.stats.extra["max_live_rows"] == 2


def test_a_seeded_row_samples_the_same_tokens_in_any_batch(monkeypatch, tiny_llama, prompts):
    """What is guaranteed of a seeded request on the static path: its tokens depend on its
    seed, its sample index and its logits, not on the rows beside it, its slot, the width or how
    often the host reads."""
    params = SamplingParams(max_new_tokens=20, temperature=1.0, top_p=0.9, n=2, seed=11)
    engine = make_engine(tiny_llama)
    alone = engine.rows(prompts[2], params)
    run_rows(engine, alone, max_width=2)
    crowd = [
        *engine.rows(prompts[0], SamplingParams(max_new_tokens=5, seed=1, n=3)),
        *engine.rows(prompts[1], greedy(30)),
    ]
    crowded = engine.rows(prompts[2], params)
    monkeypatch.setattr(static_batch, "RING_STEPS", 3)  # the host reads every 3 steps
    run_rows(engine, [*crowd, *crowded], max_width=4)  # joins after the first rows finish
    assert [row.token_ids for row in crowded] == [row.token_ids for row in alone]
    for mine, theirs in zip(crowded, alone, strict=True):
        assert mine.logprobs == pytest.approx(theirs.logprobs, abs=1e-5)
    assert alone[0].token_ids != alone[1].token_ids  # the n samples have streams of their own
    (reseeded,) = engine.generate([prompts[2]], params)[:1]
    assert reseeded.token_ids == alone[0].token_ids  # generate() numbers rows the same way


def test_the_service_runs_the_static_batch(tiny_llama, prompts):
    expected = make_engine(tiny_llama).generate(prompts, greedy(24))
    with EngineService(make_engine(tiny_llama), max_batch_size=4) as service:
        handles = [service.submit(prompt, greedy(24)) for prompt in prompts]
        results = [handle.result(timeout=60)[0] for handle in handles]
    assert [c.token_ids for c in results] == [c.token_ids for c in expected]


# --- weights and graphs --------------------------------------------------------------------------


class FakeGraphs:
    """CapturedSteps without CUDA: a new key runs what a capture runs (save, the warm-up step,
    restore), then every run replays by running the step."""

    made: ClassVar[list[FakeGraphs]] = []

    def __init__(self, device: torch.device) -> None:
        self.keys: set = set()
        self.captures, self.capture_seconds, self.clears = 0, 0.0, 0
        FakeGraphs.made.append(self)

    def run(self, key, step, *, save, restore) -> None:
        if key not in self.keys:
            saved = save()
            step()
            restore(saved)
            self.keys.add(key)
            self.captures += 1
        step()

    def clear(self) -> None:
        self.keys.clear()
        self.clears += 1

    def drop(self, which) -> None:
        self.keys = {key for key in self.keys if not which(key)}


@pytest.fixture
def fake_graphs(monkeypatch):
    FakeGraphs.made = []
    monkeypatch.setattr(static_step, "CapturedSteps", FakeGraphs)
    return FakeGraphs.made


def graphed(loaded, model=None, **overrides) -> HfEngine:
    engine = make_engine(loaded, model, **overrides)
    engine._graphs = True  # CUDA graphs are for CUDA devices: FakeGraphs stands in for them
    return engine


def test_captured_steps_sample_what_eager_steps_do_and_each_bucket_is_captured_once(
    fake_graphs, tiny_llama, prompts
):
    params = SamplingParams(max_new_tokens=12, temperature=0.8, top_k=20, n=2, seed=4)
    # max_batch_size sizes the cache once: a wider call would move it, and recapture.
    eager, captured = make_engine(tiny_llama), graphed(tiny_llama, max_batch_size=6)
    for count in (1, 3, 2, 3, 1):
        expected = eager.generate(prompts[:count], params)
        got = captured.generate(prompts[:count], params)
        assert [c.token_ids for c in got] == [c.token_ids for c in expected]
        assert [c.logprobs for c in got] == [c.logprobs for c in expected]
    (graphs,) = fake_graphs
    assert graphs.captures == len(graphs.keys) and graphs.clears == 0  # each key once
    assert {key[0] for key in graphs.keys} == {2, 4, 6}  # the widths used: 2, 4 and all 6
    assert captured.stats.extra["graph_captures"] == graphs.captures


def test_weights_loaded_in_place_are_seen_and_moved_ones_recaptured(
    fake_graphs, tiny_llama, prompts
):
    model = copy.deepcopy(tiny_llama.model)
    engine = graphed(tiny_llama, model)
    engine.generate(prompts, greedy(8))
    (graphs,) = fake_graphs
    captured = graphs.captures

    # In place, as load_state_dict and optimizers write: the same addresses, no recapture, and
    # the stacked q/k/v and gate/up copies refreshed.
    with torch.no_grad():
        changed = {name: tensor * 1.5 for name, tensor in model.state_dict().items()}
    engine.load_weights(changed, version=1)
    expected = make_engine(tiny_llama, copy.deepcopy(model)).generate(prompts, greedy(8))
    got = engine.generate(prompts, greedy(8))
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    for mine, theirs in zip(got, expected, strict=True):
        assert mine.logprobs == pytest.approx(theirs.logprobs, abs=1e-5)
    assert graphs.captures == captured and graphs.clears == 0

    # A parameter replaced by a new tensor (an adapter merged, a `.to()`): the graphs read the
    # old one, so they are dropped and captured again, even without load_weights.
    projection = model.model.layers[0].self_attn.o_proj
    projection.weight = torch.nn.Parameter(projection.weight.detach() * -1.0)
    expected = make_engine(tiny_llama, copy.deepcopy(model)).generate(prompts, greedy(8))
    got = engine.generate(prompts, greedy(8))
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    assert graphs.clears == 1 and graphs.captures > captured

    # A new dtype: a new cache and new graphs.
    model.double()
    got = engine.generate(prompts, greedy(8))
    assert engine._static is not None and engine._static.keys.dtype == torch.float64
    assert len(fake_graphs) == 2


# --- what the static path serves, and the knob ---------------------------------------------------


def test_models_the_static_step_does_not_serve(tiny_llama):
    model = copy.deepcopy(tiny_llama.model)
    assert supports_static(model)
    model.config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}
    assert not supports_static(model)  # its rotary table depends on the sequence length
    with pytest.raises(ValueError, match="Llama-family"):
        make_engine(tiny_llama, model)
    hooked = copy.deepcopy(tiny_llama.model)
    hooked.model.layers[0].mlp.register_forward_hook(lambda *_: None)
    assert not supports_static(hooked)


def test_cuda_graphs_are_refused_off_cuda_and_auto_keeps_the_cpu_path(tiny_llama, prompts):
    with pytest.raises(ValueError, match="needs a CUDA device"):
        make_engine(tiny_llama, cuda_graphs=True)
    with pytest.raises(ValueError, match="static=False refuses"):
        make_engine(tiny_llama, static=False, cuda_graphs=True, device="cuda")
    auto = make_engine(tiny_llama, static=None)
    auto.generate(prompts, greedy(4))
    assert auto._static is None and "host_reads" not in auto.stats.extra  # DecodeBatch ran
    forced = make_engine(tiny_llama, cuda_graphs=False)
    forced.generate(prompts, greedy(4))
    assert forced._static is not None and forced.stats.extra["graph_captures"] == 0


def test_plan_refuses_cuda_graphs_where_they_cannot_run():
    from rollout.config.generation import GenerationSection
    from rollout.planner.builder import cuda_graph_issues

    required = GenerationSection(cuda_graphs=True)
    assert cuda_graph_issues(required, "cuda", "llama", where="test") == []
    (off_gpu,) = cuda_graph_issues(required, "cpu", "qwen2", where="cluster.device = 'auto'")
    assert off_gpu.path == "generation.cuda_graphs" and "runs on cpu" in off_gpu.message
    (other_model,) = cuda_graph_issues(required, "cuda", "gpt2", where="test")
    assert "'gpt2'" in other_model.message and "vllm" in other_model.hint
    vllm = GenerationSection(cuda_graphs=True, engine="vllm")
    assert cuda_graph_issues(vllm, "cuda", "gpt2", where="test") == []  # vLLM's own graphs
    for setting in ("auto", False):
        assert (
            cuda_graph_issues(GenerationSection(cuda_graphs=setting), "cpu", "gpt2", where="") == []
        )
