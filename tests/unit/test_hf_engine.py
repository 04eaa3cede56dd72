"""The hf engine: what it reports must be what the learner recomputes, batching must not change
what a prompt gets, and finish reasons, stop strings, seeds and grouping behave as documented."""

from __future__ import annotations

import copy
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from rollout.config.model import LoraSection
from rollout.engines.base import Completion, SamplingParams, cache_keyword, cut_at_stop
from rollout.engines.hf import decode_batch
from rollout.engines.hf import engine as hf_engine
from rollout.engines.hf import packing as hf_packing
from rollout.engines.hf.adapters import is_lora_linear
from rollout.engines.hf.engine import HfEngine, eval_mode
from rollout.engines.hf.kv_cache import PreallocatedLayer, preallocated_cache
from rollout.engines.hf.llama_decoder import LlamaDecoder, attention_bias
from rollout.engines.hf.prompts import left_pad, shared_prefix_length
from rollout.engines.hf.static_step import supports_static
from rollout.engines.sampling import (
    sample_proportional,
    sample_rows,
    sample_tokens,
    truncate,
    truncate_rows,
)
from rollout.models.loading import apply_chat_template
from rollout.models.lora import add_adapters

LOGPROB_TOLERANCE = 1e-4
"""Max abs difference between the engine's and the learner's log-probs, in float32. Measured:
about 1e-6 (cached decoding and a full forward add up the same products in another order)."""

QUESTIONS = ("What is 2 + 3?", "Hi", "Compute 12 * 7 - 7, then explain the answer step by step.")


@pytest.fixture(scope="module")
def prompts(tiny_llama) -> list[list[int]]:
    """Chat prompts of different lengths (17, 13 and 35 tokens)."""
    return [
        apply_chat_template(tiny_llama.tokenizer, tiny_llama.chat_template, q, None)
        for q in QUESTIONS
    ]


def make_engine(loaded, **overrides) -> HfEngine:
    """An engine on a LoadedModel, seeded; `overrides` replace constructor arguments."""
    arguments = {
        "eos_token_ids": loaded.eos_token_ids,
        "pad_token_id": loaded.pad_token_id,
        "tokenizer": loaded.tokenizer,
        "seed": 0,
    }
    return HfEngine(loaded.model, **{**arguments, **overrides})


@pytest.fixture(params=["dynamic", "static"])
def engine(request, tiny_llama) -> HfEngine:
    """The engine on each decode path: DecodeBatch (the CPU's), and the static step that CUDA
    devices take (StaticDecodeBatch; here run eagerly, without CUDA graphs)."""
    return make_engine(tiny_llama, static=request.param == "static")


def greedy(max_new_tokens: int = 16, **kwargs) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, **kwargs)


def learner_logprobs(
    model, prompts: list[list[int]], completions: list[Completion], temperature: float
) -> list[list[float]]:
    """What the learner computes: one forward over prompt + completion, right-padded, no cache,
    log_softmax(logits / T) at each completion token (predicted from the position before it)."""
    sequences = [prompts[c.prompt_index] + c.token_ids for c in completions]
    width = max(len(s) for s in sequences)
    input_ids = torch.zeros(len(sequences), width, dtype=torch.long)
    attention_mask = torch.zeros(len(sequences), width, dtype=torch.long)
    for row, sequence in enumerate(sequences):
        input_ids[row, : len(sequence)] = torch.tensor(sequence)
        attention_mask[row, : len(sequence)] = 1
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.float()
    logprobs = (logits / (temperature or 1.0)).log_softmax(-1)  # [B, S, V]
    result = []
    for row, completion in enumerate(completions):
        start = len(prompts[completion.prompt_index])
        targets = torch.tensor(completion.token_ids)
        predicted = logprobs[row, start - 1 : start - 1 + len(targets)]
        result.append(predicted.gather(-1, targets[:, None]).squeeze(-1).tolist())
    return result


# --- the contract with the learner -----------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=12, temperature=1.0, n=2, seed=1),
        SamplingParams(max_new_tokens=12, temperature=0.7, n=2, seed=2),
        # Truncation changes what is sampled, never the reported (untruncated) log-probs.
        SamplingParams(max_new_tokens=12, temperature=0.7, top_k=50, top_p=0.9, n=2, seed=3),
        greedy(12),
    ],
    ids=["t1.0", "t0.7", "t0.7-top_k-top_p", "greedy"],
)
def test_logprobs_match_the_learners_recomputation(tiny_llama, engine, prompts, params):
    completions = engine.generate(prompts, params)
    expected = learner_logprobs(tiny_llama.model, prompts, completions, params.temperature)
    worst = 0.0
    for completion, learner in zip(completions, expected, strict=True):
        assert len(completion.logprobs) == len(completion.token_ids) == len(learner)
        worst = max(worst, *(abs(a - b) for a, b in zip(completion.logprobs, learner, strict=True)))
    assert worst < LOGPROB_TOLERANCE


def test_batching_and_left_padding_change_nothing(tiny_llama, engine, prompts):
    together = engine.generate(prompts, greedy())
    chunked = make_engine(tiny_llama, max_batch_size=2).generate(prompts, greedy())
    for index, prompt in enumerate(prompts):
        (alone,) = engine.generate([prompt], greedy())
        assert together[index].token_ids == chunked[index].token_ids == alone.token_ids
        assert together[index].logprobs == pytest.approx(alone.logprobs, abs=1e-5)
    # The tiny model is random but not degenerate: prompts get different continuations.
    assert len({tuple(c.token_ids) for c in together}) == len(prompts)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_top_k_1_is_greedy(engine, prompts, temperature):
    expected = engine.generate(prompts, greedy())
    sampled = engine.generate(
        prompts, SamplingParams(max_new_tokens=16, temperature=temperature, top_k=1)
    )
    assert [c.token_ids for c in sampled] == [c.token_ids for c in expected]
    if temperature == 1.0:  # greedy reports T=1 log-probs
        assert [c.logprobs for c in sampled] == [c.logprobs for c in expected]


def test_repeated_prompts_are_prefilled_once_and_sampled_as_alone(engine, prompts):
    # n > 1 and a prompt listed twice both share one prefill; greedy rows must still agree.
    alone = [engine.generate([prompt], greedy())[0] for prompt in prompts]
    completions = engine.generate([*prompts, prompts[0]], greedy(n=2))
    expected = [c for c in (*alone, alone[0]) for _ in range(2)]
    for completion, reference in zip(completions, expected, strict=True):
        assert completion.token_ids == reference.token_ids
        assert completion.logprobs == pytest.approx(reference.logprobs, abs=1e-5)


# --- continuous batching -----------------------------------------------------------------------


def test_generate_refills_a_finished_slot_at_once(tiny_llama, engine, prompts):
    # Pretend the 4th token of prompt 0 ends a turn: its row finishes early, and with room for
    # two rows prompt 2 must take its slot then, not wait for prompt 1's row to finish too.
    reference = engine.generate(prompts, greedy())
    eos = reference[0].token_ids[3]
    assert all(eos not in c.token_ids for c in reference[1:]), "pick another token"
    narrow = make_engine(tiny_llama, eos_token_ids=[eos], max_batch_size=2)
    completions = narrow.generate(prompts, greedy())
    assert [c.token_ids for c in completions] == [reference[0].token_ids[:4]] + [
        c.token_ids for c in reference[1:]
    ]
    for completion, full in zip(completions, reference, strict=True):
        assert completion.logprobs == pytest.approx(
            full.logprobs[: len(completion.logprobs)], abs=1e-5
        )
    # Static chunks would take 15 + 15 decode steps; refilled after its 4th token, prompt 2
    # samples its first token in the 5th round (after that round's decode step), so 4 + 15 do.
    assert narrow.stats.extra["decode_steps"] == 4 + 15
    assert narrow.stats.extra["max_live_rows"] == 2


def test_rows_joining_a_running_batch_sample_as_alone(tiny_llama, engine, prompts):
    """A DecodeBatch of adaptive width fed rows while it runs, each with its own parameters:
    greedy rows get what they get alone, sampled rows report what the learner recomputes, and
    the layout moves (a longer prompt than the batch holds, a wider batch) change nothing."""
    long_prompt = apply_chat_template(
        tiny_llama.tokenizer, tiny_llama.chat_template, " ".join(["count with me"] * 20), None
    )
    requests = [
        (prompts[1], SamplingParams(max_new_tokens=3, temperature=0.0)),
        (prompts[0], SamplingParams(max_new_tokens=20, temperature=0.8, seed=1)),
        (long_prompt, SamplingParams(max_new_tokens=7, temperature=0.0)),
        (prompts[2], SamplingParams(max_new_tokens=12, temperature=0.7, top_k=5, seed=2, n=2)),
        (prompts[1], SamplingParams(max_new_tokens=30, temperature=0.0)),
        (prompts[0], SamplingParams(max_new_tokens=9, temperature=1.0, top_p=0.8, seed=3)),
    ]
    batch = engine.decode_batch(max_width=4)
    rows = [
        engine.rows(prompt, params, prompt_index=i) for i, (prompt, params) in enumerate(requests)
    ]
    widths = set()
    with eval_mode(tiny_llama.model), torch.inference_mode():
        batch.add(rows[0] + rows[1])
        for step in range(200):
            if step % 3 == 2 and step // 3 + 2 < len(rows):
                batch.add(rows[step // 3 + 2])  # a new request every third step
            batch.step()
            widths.add(batch.width)
            if not batch.busy and step // 3 + 2 >= len(rows):
                break
    assert not batch.busy
    if isinstance(batch, decode_batch.DecodeBatch):
        assert engine.stats.extra["relayouts"] >= 2  # the long prompt moved it, the widths too
        assert {1, 4} <= widths  # grew for the queue, shrank when one row was left
    else:  # slotted: a longer prompt moves nothing; narrowing moves the rows to the left
        assert engine.stats.extra["compactions"] >= 1
        assert {1, 2} <= widths  # up to 8 tokens a step: the queue never needed 4 slots
    for (prompt, params), request_rows in zip(requests, rows, strict=True):
        for row in request_rows:
            completion = engine.completion(row)
            if completion.finish_reason != "eos":
                assert len(completion.token_ids) == params.max_new_tokens
            (expected,) = learner_logprobs(
                tiny_llama.model,
                [prompt],
                [replace(completion, prompt_index=0)],
                params.temperature,
            )
            assert completion.logprobs == pytest.approx(expected, abs=LOGPROB_TOLERANCE)
            if params.temperature == 0:
                (alone,) = engine.generate([prompt], params)
                assert completion.token_ids == alone.token_ids


def test_sample_rows_is_sample_tokens_row_by_row():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)) * 3
    settings = [
        (0.0, 0, 1.0),
        (1.0, 0, 1.0),
        (0.7, 5, 1.0),
        (0.7, 0, 0.8),
        (1.3, 3, 0.5),
        (0.5, 1, 1.0),
    ]
    temperature, top_k, top_p = (torch.tensor(column) for column in zip(*settings, strict=True))

    def draw(row):  # sample_tokens' own draw for one row: torch.rand([1, 1]) from this generator
        return torch.Generator().manual_seed(100 + row)

    uniform = torch.cat([torch.rand(1, 1, generator=draw(row))[0] for row in range(6)])
    token_ids, logprobs, top = sample_rows(logits, temperature, top_k, top_p, uniform)
    assert top is None  # no row asked for alternatives: none are computed
    for row, (t, k, p) in enumerate(settings):
        params = SamplingParams(max_new_tokens=1, temperature=t, top_k=k, top_p=p)
        expected_ids, expected_logprobs, _ = sample_tokens(logits[row : row + 1], params, draw(row))
        assert token_ids[row] == expected_ids[0]
        assert logprobs[row].item() == pytest.approx(expected_logprobs[0].item(), abs=1e-6)
        reference = (logits[row] / (t or 1.0)).log_softmax(-1)[token_ids[row]]
        assert logprobs[row].item() == pytest.approx(reference.item(), abs=1e-5)
    assert token_ids[0] == logits[0].argmax() and token_ids[5] == logits[5].argmax()


KNOWN_LOGITS = torch.tensor(
    [[2.0, -1.0, 0.5, 3.0, 0.0, -2.0, 1.5, 0.25], [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8]]
)


@pytest.mark.parametrize("temperature", [0.0, 0.5, 1.0, 1.7])
def test_top_logprobs_are_the_top_of_the_sampled_tokens_distribution(temperature):
    """Alternatives are log_softmax(logits / T).topk(N), from before top-k/top-p truncation,
    and the sampled token's log-prob is exactly its entry when it is among them."""
    params = SamplingParams(max_new_tokens=1, temperature=temperature, top_k=3, top_logprobs=4)
    token_ids, logprobs, top = sample_tokens(KNOWN_LOGITS, params, torch.Generator().manual_seed(0))
    expected = torch.log_softmax(KNOWN_LOGITS / (temperature or 1.0), -1).topk(4)
    assert torch.equal(top.token_ids, expected.indices)
    assert torch.allclose(top.logprobs, expected.values, atol=1e-6)
    assert torch.equal(top.token_ids[0], torch.tensor([3, 0, 6, 2]))  # by hand: 3.0, 2.0, 1.5, 0.5
    for row in range(2):  # top_k 3 samples among the top 4: the sampled token is listed
        alternatives = dict(
            zip(top.token_ids[row].tolist(), top.logprobs[row].tolist(), strict=True)
        )
        assert alternatives[token_ids[row].item()] == logprobs[row].item()
    if temperature == 0:
        assert token_ids.tolist() == top.token_ids[:, 0].tolist()  # greedy: the most likely
    # Per row: each row's own temperature, the most alternatives any row asked for.
    rows = sample_rows(
        KNOWN_LOGITS,
        torch.tensor([temperature, 1.0]),
        torch.tensor([0, 0]),
        torch.tensor([1.0, 1.0]),
        torch.tensor([0.3, 0.6]),
        top=4,
    )
    assert torch.equal(rows.top.token_ids[0], expected.indices[0])
    assert torch.allclose(rows.top.logprobs[0], expected.values[0], atol=1e-6)
    other = torch.log_softmax(KNOWN_LOGITS[1], -1).topk(4)
    assert torch.allclose(rows.top.logprobs[1], other.values, atol=1e-6)
    assert sample_tokens(KNOWN_LOGITS, replace(params, top_logprobs=0), None).top is None


def test_completions_carry_top_logprobs_per_token_in_both_sampling_paths(engine, prompts):
    (default,) = engine.generate(prompts[:1], greedy(6))
    assert default.top_logprobs is None
    (greedy_top,) = engine.generate(prompts[:1], greedy(6, top_logprobs=3))
    assert greedy_top.token_ids == default.token_ids
    assert len(greedy_top.top_logprobs) == len(greedy_top.token_ids)
    for token_id, logprob, alternatives in zip(
        greedy_top.token_ids, greedy_top.logprobs, greedy_top.top_logprobs, strict=True
    ):
        assert len(alternatives) == 3
        assert alternatives[0] == (token_id, logprob)  # greedy: the most likely, exactly
        assert [value for _, value in alternatives] == sorted(
            (value for _, value in alternatives), reverse=True
        )
    # Rows with their own parameters in one batch (sample_rows): each keeps its own count.
    requests = [greedy(6, top_logprobs=2), SamplingParams(max_new_tokens=6, seed=1), greedy(6)]
    batch = engine.decode_batch(max_width=4)
    rows = [engine.rows(prompts[0], params)[0] for params in requests]
    with eval_mode(engine.model), torch.inference_mode():
        batch.add(rows)
        while batch.busy:
            batch.step()
    two, sampled, plain = (engine.completion(row) for row in rows)
    assert two.token_ids == greedy_top.token_ids
    for mine, alone in zip(two.top_logprobs, greedy_top.top_logprobs, strict=True):
        assert [t for t, _ in mine] == [t for t, _ in alone[:2]]
        assert [v for _, v in mine] == pytest.approx([v for _, v in alone[:2]], abs=1e-5)
    assert sampled.top_logprobs is None and plain.top_logprobs is None


def test_truncate_rows_is_truncate_row_by_row():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(1))
    settings = [(0, 1.0), (3, 1.0), (0, 0.6), (7, 0.3)]
    top_k, top_p = (torch.tensor(column) for column in zip(*settings, strict=True))
    truncated = truncate_rows(logits, top_k, top_p)
    for row, (k, p) in enumerate(settings):
        assert torch.equal(
            truncated[row : row + 1], truncate(logits[row : row + 1], top_k=k, top_p=p)
        )


# --- the decode step -------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def family_model(request, tiny_llama, rollout_cache):
    """The tiny Llama and the tiny Qwen2 (biases on q, k and v): both decode with LlamaDecoder."""
    if request.param == "llama":
        return tiny_llama
    from rollout.config.model import ModelSection
    from rollout.models.loading import load_model
    from rollout.planner.inspect_model import inspect_model

    section = ModelSection(builtin="tiny-qwen2")
    facts = inspect_model(section, base_dir=Path.cwd())
    return load_model(facts, section, dtype="float32", device="cpu")


DECODE_PATHS = ["model-forward", "written-out", "packed-onednn", "packed-mkl"]


def _decode_paths(monkeypatch, path: str) -> None:
    """Force one decode path: the model's own forward, or LlamaDecoder without packing or with
    one of the packing kernels (skipped where this torch lacks it)."""
    if path == "model-forward":
        monkeypatch.setattr(LlamaDecoder, "supports", staticmethod(lambda *_: False))
        return
    packing = path.startswith("packed")
    monkeypatch.setattr(hf_engine, "should_pack", lambda *_: packing)
    if packing:
        kernel = path.removeprefix("packed-")
        available = {
            "onednn": torch.backends.mkldnn.is_available(),
            "mkl": torch.backends.mkl.is_available(),
        }
        if not available[kernel]:
            pytest.skip(f"torch without {kernel}: no packed GEMM of that kind")
        for module in (hf_engine, hf_packing):  # the engine and packed_width ask for it
            monkeypatch.setattr(module, "packing_kernel", lambda: kernel)


@pytest.mark.parametrize("path", [*DECODE_PATHS, "static"])
def test_every_decode_path_matches_the_learner(monkeypatch, family_model, prompts, path):
    engine = make_engine(family_model, static=path == "static")
    assert LlamaDecoder.supports(
        family_model.model, preallocated_cache(family_model.model.config, 8)
    )
    if path != "static":
        _decode_paths(monkeypatch, path)
    params = SamplingParams(max_new_tokens=12, temperature=0.7, n=2, seed=4)
    completions = engine.generate(prompts, params)
    expected = learner_logprobs(family_model.model, prompts, completions, params.temperature)
    for completion, learner in zip(completions, expected, strict=True):
        assert completion.logprobs == pytest.approx(learner, abs=LOGPROB_TOLERANCE)


def test_decode_paths_sample_the_same_tokens(monkeypatch, tiny_llama, prompts):
    def sample(path):
        with monkeypatch.context() as patch:
            _decode_paths(patch, path)
            params = SamplingParams(max_new_tokens=16, temperature=1.0, n=2, seed=11)
            return make_engine(tiny_llama).generate(prompts, params)

    reference = sample("model-forward")
    for path in DECODE_PATHS[1:]:
        completions = sample(path)
        assert [c.token_ids for c in completions] == [c.token_ids for c in reference]
        for completion, expected in zip(completions, reference, strict=True):
            assert completion.logprobs == pytest.approx(expected.logprobs, abs=1e-5)


def test_hooked_or_unfamiliar_models_run_their_own_forward(tiny_llama):
    model = tiny_llama.model
    cache = preallocated_cache(model.config, 8)
    assert LlamaDecoder.supports(model, cache)
    # A hook on a module the written-out step calls (the embedding, as gradient checkpointing
    # adds) runs anyway; one on a module it bypasses would be skipped.
    embedding_hook = model.model.embed_tokens.register_forward_hook(lambda *_: None)
    mlp_hook = model.model.layers[0].mlp.register_forward_hook(lambda *_: None)
    try:
        assert not LlamaDecoder.supports(model, cache)
        mlp_hook.remove()
        assert LlamaDecoder.supports(model, cache)
    finally:
        embedding_hook.remove()
        mlp_hook.remove()
    # Layers without a preallocated cache (e.g. sliding-window ones) are not written out.
    assert not LlamaDecoder.supports(model, DynamicCache(config=model.config))


# --- the prefill -------------------------------------------------------------------------------


def test_shared_prefix_length_leaves_every_prompt_a_token_to_run():
    assert shared_prefix_length([[1, 2, 3, 4], [1, 2, 3, 5, 6]]) == 3
    assert shared_prefix_length([[1, 2, 3], [1, 2, 3, 4]]) == 2
    assert shared_prefix_length([[7, 2], [8, 2]]) == 0
    assert shared_prefix_length([[1, 2, 3]]) == 0  # one prompt: nothing to share


def test_attention_bias_is_causal_padded_and_lets_padding_see_itself():
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    bias = attention_bias(mask, new=3, dtype=torch.float32)  # the last 3 of 4 columns
    visible = (bias == 0).squeeze(1).int().tolist()
    assert visible[0] == [[0, 1, 0, 0], [0, 1, 1, 0], [0, 1, 1, 1]]
    assert visible[1] == [[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    padding_only = attention_bias(torch.tensor([[0, 0, 1]]), new=3, dtype=torch.float32)
    assert (padding_only[0, 0, 0] == 0).int().tolist() == [1, 0, 0]  # sees itself, not NaN
    decode = attention_bias(mask, new=1, dtype=torch.float32)
    assert decode.shape == (2, 1, 1, 4) and (decode[0, 0, 0] == 0).int().tolist() == [0, 1, 1, 1]


@pytest.mark.parametrize("path", DECODE_PATHS[1:])
def test_written_out_prefill_matches_the_models_forward(monkeypatch, family_model, prompts, path):
    """LlamaDecoder.forward over left-padded prompts: the model's last-position logits, and the
    keys and values the model's own forward caches (padding columns aside)."""
    _decode_paths(monkeypatch, path)
    model = family_model.model
    kernel = hf_packing.packing_kernel() if hf_engine.should_pack(model, 64) else None
    decoder = LlamaDecoder(model, len(prompts), kernel=kernel)
    input_ids, mask = left_pad(prompts, family_model.pad_token_id, torch.device("cpu"))
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    width = input_ids.shape[1]
    ours, theirs = preallocated_cache(model.config, width), DynamicCache(config=model.config)
    with torch.inference_mode():
        logits = decoder.forward(input_ids, positions, mask, ours)
        expected = model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            **{cache_keyword(model): theirs},
            use_cache=True,
        ).logits[:, -1]
    assert torch.allclose(logits, expected, atol=1e-4)
    real = mask.bool()
    for layer, reference in zip(ours.layers, theirs.layers, strict=True):
        for mine, model_states in ((layer.keys, reference.keys), (layer.values, reference.values)):
            assert torch.allclose(
                mine.transpose(1, 2)[real], model_states.transpose(1, 2)[real], atol=1e-5
            )


SYSTEM = "You are a careful calculator. Think, then answer with one number."


def test_a_shared_prompt_prefix_is_prefilled_once_and_changes_nothing(monkeypatch, tiny_llama):
    """Prompts with one system prompt share a long prefix: computed once (place_prefix), they
    sample what a full prefill samples, in a static batch and when rows join a running one."""
    questions = ("What is 2 + 3?", "Hi", "Compute 12 * 7 - 7, then explain.", "Why?", "1+1")
    prompts = [
        apply_chat_template(tiny_llama.tokenizer, tiny_llama.chat_template, q, SYSTEM)
        for q in questions
    ]
    assert shared_prefix_length(prompts) >= 10
    placed = []
    place_prefix = PreallocatedLayer.place_prefix

    def spy(layer, keys, values, firsts, length):
        placed.append(keys.shape[-2])
        place_prefix(layer, keys, values, firsts, length)

    def sample(shared: bool, max_batch_size: int | None):
        with monkeypatch.context() as patch:
            patch.setattr(PreallocatedLayer, "place_prefix", spy)
            if not shared:
                patch.setattr(decode_batch, "SHARED_PREFIX_MIN_TOKENS", 10**9)
            engine = make_engine(tiny_llama, max_batch_size=max_batch_size)
            return engine.generate(prompts, greedy(12, n=2))

    for max_batch_size in (None, 4):  # 4 slots for 10 rows: refills share prefixes too
        placed.clear()
        full = sample(shared=False, max_batch_size=max_batch_size)
        assert placed == []
        once = sample(shared=True, max_batch_size=max_batch_size)
        assert placed and min(placed) >= 10
        assert [c.token_ids for c in once] == [c.token_ids for c in full]
        for mine, reference in zip(once, full, strict=True):
            assert mine.logprobs == pytest.approx(reference.logprobs, abs=1e-5)
    expected = learner_logprobs(tiny_llama.model, prompts, once, 1.0)
    for completion, learner in zip(once, expected, strict=True):
        assert completion.logprobs == pytest.approx(learner, abs=LOGPROB_TOLERANCE)


# --- sampling randomness ---------------------------------------------------------------------


def test_sample_proportional_draws_by_weight_and_never_a_zero_weight():
    generator = torch.Generator().manual_seed(0)
    weights = torch.tensor([[0.0, 1.0, 0.0, 3.0, 0.0]]).repeat(4000, 1)
    drawn = sample_proportional(weights, generator)
    counts = torch.bincount(drawn, minlength=5).tolist()
    assert counts[0] == counts[2] == counts[4] == 0
    assert counts[3] / len(drawn) == pytest.approx(0.75, abs=0.03)
    only = torch.tensor([[0.0, 0.0, 2.0, 0.0]]).repeat(100, 1)
    assert sample_proportional(only, generator).tolist() == [2] * 100


def test_seeded_sampling_is_reproducible_and_seeds_differ(engine, prompts):
    def sample(seed):
        params = SamplingParams(max_new_tokens=16, temperature=1.0, n=2, seed=seed)
        return [c.token_ids for c in engine.generate(prompts, params)]

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_unseeded_calls_draw_from_the_engine_generator(tiny_llama, prompts):
    params = SamplingParams(max_new_tokens=16, temperature=1.0)
    first, second = make_engine(tiny_llama, seed=5), make_engine(tiny_llama, seed=5)
    assert first.generate(prompts, params) == second.generate(prompts, params)  # same seed
    assert first.generate(prompts, params) != first.generate(prompts, params)  # the stream moves on


# --- finishing ---------------------------------------------------------------------------------


def test_length(engine, prompts):
    for completion in engine.generate(prompts, greedy(5)):
        assert completion.finish_reason == "length"
        assert len(completion.token_ids) == len(completion.logprobs) == 5


def test_eos_is_included_and_ends_only_its_row(tiny_llama, engine, prompts):
    reference = engine.generate(prompts, greedy())
    eos = reference[0].token_ids[3]  # pretend the 4th token of prompt 0 ends a turn
    completions = make_engine(tiny_llama, eos_token_ids=[eos]).generate(prompts, greedy())
    for completion, full in zip(completions, reference, strict=True):
        if eos in full.token_ids:
            end = full.token_ids.index(eos) + 1
            assert completion.token_ids == full.token_ids[:end]
            assert completion.logprobs == pytest.approx(full.logprobs[:end], abs=1e-5)
            assert completion.finish_reason == "eos"
        else:  # the other rows go on to max_new_tokens, unaffected
            assert completion.token_ids == full.token_ids
            assert completion.finish_reason == "length"
    assert completions[0].finish_reason == "eos"


def test_stop_string_cuts_text_and_tokens(tiny_llama, engine, prompts):
    (full,) = engine.generate(prompts[:1], greedy(24))
    decode = tiny_llama.tokenizer.decode
    # A stop string of two whole tokens, from the middle of the text, found nowhere before.
    for start in range(2, len(full.token_ids) - 2):
        stop = decode(full.token_ids[start : start + 2])
        before = decode(full.token_ids[:start])
        if stop.isprintable() and decode(full.token_ids).find(stop) == len(before):
            break
    else:
        pytest.fail(f"no usable stop string in {full.text!r}")

    (completion,) = engine.generate(prompts[:1], greedy(24, stop=("never produced", stop)))
    assert completion.finish_reason == "stop"
    assert completion.text == before
    assert completion.token_ids == full.token_ids[:start]
    assert completion.logprobs == full.logprobs[:start]


def test_cut_at_stop(tiny_llama):
    tokenizer = tiny_llama.tokenizer
    ids = tokenizer.encode("The answer is 42.\nNext line", add_special_tokens=False)

    def decode(token_ids):
        return tokenizer.decode(token_ids)

    keep, text = cut_at_stop(ids, ("\n", "line"), decode)
    assert text == "The answer is 42."
    assert decode(ids[:keep]) == text
    # The earliest stop string wins, whichever is listed first.
    assert cut_at_stop(ids, ("line", " is"), decode)[1] == "The answer"
    # A stop string that starts inside a token: the token goes, the text keeps its first part.
    keep, text = cut_at_stop(ids, ("swer",), decode)
    assert text == "The an"
    assert text.startswith(decode(ids[:keep]))
    assert decode(ids[: keep + 1]).find("swer") >= 0
    assert cut_at_stop(ids, ("absent",), decode) == (len(ids), decode(ids))


# --- grouping, weights, bookkeeping ------------------------------------------------------------


def test_n_completions_are_grouped_by_prompt(engine, prompts):
    completions = engine.generate(prompts[:2], SamplingParams(max_new_tokens=8, n=3, seed=0))
    assert [c.prompt_index for c in completions] == [0, 0, 0, 1, 1, 1]
    assert len({tuple(c.token_ids) for c in completions[:3]}) > 1  # independent samples


def test_load_weights(tiny_llama, engine, prompts):
    model = tiny_llama.model
    engine.load_weights(None, version=3)
    assert engine.policy_version == 3
    assert {c.policy_version for c in engine.generate(prompts, greedy(2))} == {3}

    original = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    try:
        changed = {name: tensor * 1.5 for name, tensor in original.items()}
        engine.load_weights(changed, version=4)
        assert torch.equal(model.model.norm.weight, changed["model.norm.weight"])
        with pytest.raises(RuntimeError, match="Missing key"):
            engine.load_weights({"model.norm.weight": original["model.norm.weight"]}, version=5)
    finally:
        model.load_state_dict(original)
    assert engine.policy_version == 4


def test_a_model_in_train_mode_samples_as_in_eval_mode_and_stays_in_train_mode(
    tiny_llama, engine, prompts
):
    expected = engine.generate(prompts, greedy(8))
    tiny_llama.model.train()
    try:
        assert engine.generate(prompts, greedy(8)) == expected
        assert tiny_llama.model.training
    finally:
        tiny_llama.model.eval()


def test_stats_and_generate_one(engine, prompts):
    completions = engine.generate_one(prompts[0], SamplingParams(max_new_tokens=4, n=2, seed=0))
    assert [c.prompt_index for c in completions] == [0, 0]
    assert engine.stats.prompt_tokens == 2 * len(prompts[0])
    assert engine.stats.generated_tokens == 8
    assert engine.stats.seconds > 0


def test_empty_prompt_is_refused(engine):
    with pytest.raises(ValueError, match="no tokens"):
        engine.generate([[1, 2], []], greedy(2))


# --- truncation by hand ------------------------------------------------------------------------


def test_truncate_top_k_and_top_p():
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    logits = probs.log()
    kept = lambda out: (out > -math.inf).squeeze(0).tolist()  # noqa: E731
    assert kept(truncate(logits, top_k=2, top_p=1.0)) == [False, True, False, True]
    # The nucleus is the smallest set reaching top_p: 0.5 + 0.3 = 0.8.
    assert kept(truncate(logits, top_k=0, top_p=0.8)) == [False, True, False, True]
    assert kept(truncate(logits, top_k=0, top_p=0.81)) == [False, True, True, True]
    assert kept(truncate(logits, top_k=0, top_p=0.01)) == [False, True, False, False]
    assert kept(truncate(logits, top_k=0, top_p=1.0)) == [True] * 4


# --- a real model (slow) -----------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_logprobs_and_batching(smollm2):
    questions = ("What is 2 + 3?", "Name a color.")
    prompts = [
        apply_chat_template(smollm2.tokenizer, smollm2.chat_template, q, None) for q in questions
    ]
    engine = make_engine(smollm2)
    params = SamplingParams(max_new_tokens=16, temperature=0.7, n=2, seed=0)
    completions = engine.generate(prompts, params)
    expected = learner_logprobs(smollm2.model, prompts, completions, params.temperature)
    for completion, learner in zip(completions, expected, strict=True):
        assert completion.logprobs == pytest.approx(learner, abs=LOGPROB_TOLERANCE)
    together = engine.generate(prompts, greedy())
    for prompt, completion in zip(prompts, together, strict=True):
        assert engine.generate([prompt], greedy())[0].token_ids == completion.token_ids


def test_kept_packed_weights_are_reused_until_the_weights_move(tiny_llama, prompts):
    """keep_packed: the second call samples what a fresh engine samples, with the same packed
    decoder; load_weights makes the next call pack anew."""
    from rollout.engines.hf.engine import HfEngine
    from rollout.engines.hf.packing import should_pack

    params = SamplingParams(max_new_tokens=16, n=2, seed=3)
    assert should_pack(tiny_llama.model, params.max_new_tokens)

    def engine(keep: bool) -> HfEngine:
        return HfEngine(
            tiny_llama.model,
            eos_token_ids=tiny_llama.eos_token_ids,
            pad_token_id=tiny_llama.pad_token_id,
            tokenizer=tiny_llama.tokenizer,
            keep_packed=keep,
        )

    kept = engine(True)
    first = kept.generate(prompts, params)
    decoder = kept._kept[1]
    second = kept.generate(prompts, params)
    assert kept._kept[1] is decoder  # packed once
    fresh = engine(False).generate(prompts, params)
    assert (
        [c.token_ids for c in second]
        == [c.token_ids for c in first]
        == [c.token_ids for c in fresh]
    )
    kept.load_weights(None, version=1)
    kept.generate(prompts, params)
    assert kept._kept[1] is not decoder  # the weights may have moved: packed again


# --- LoRA: the engine samples from the adapted policy, as the learner computes it --------------


@pytest.fixture(scope="module")
def adapted(tiny_llama):
    """tiny-llama with LoRA on every projection, its adapters moved off zero (a fresh adapter
    is exactly the base model: B starts at 0), as after some training."""
    model = copy.deepcopy(tiny_llama.model)
    adapters = add_adapters(model, LoraSection(rank=4, alpha=8.0))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in adapters.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    return replace(tiny_llama, model=adapters.model), adapters


def test_the_static_step_refuses_an_adapted_model(adapted):
    """The static step reads the base weights (a peft layer's .weight is its base layer's), so it
    must never serve an adapted model: it would sample without the adapters."""
    loaded, _ = adapted
    assert not supports_static(loaded.model)
    with pytest.raises(ValueError, match="static decode step serves"):
        make_engine(loaded, static=True)


@pytest.mark.parametrize("path", DECODE_PATHS)
def test_every_decode_path_samples_with_the_adapters(monkeypatch, adapted, prompts, path):
    loaded, adapters = adapted
    model = loaded.model
    assert any(is_lora_linear(m) for m in model.modules())
    # LoRA layers no longer send the engine to the model's own forward: they are computed.
    assert LlamaDecoder.supports(model, preallocated_cache(model.config, 8))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _decode_paths(monkeypatch, path)
    params = SamplingParams(max_new_tokens=12, temperature=0.7, n=2, seed=4)
    completions = make_engine(loaded).generate(prompts, params)

    expected = learner_logprobs(model, prompts, completions, params.temperature)
    for completion, learner in zip(completions, expected, strict=True):
        assert completion.logprobs == pytest.approx(learner, abs=LOGPROB_TOLERANCE)
    # The adapters matter: the base model gives these tokens other log-probs.
    base = learner_logprobs(adapters.without_adapters(), prompts, completions, 0.7)
    gaps = [
        abs(a - b)
        for completion, row in zip(completions, base, strict=True)
        for a, b in zip(completion.logprobs, row, strict=True)
    ]
    assert max(gaps) > 100 * LOGPROB_TOLERANCE
    # Sampling merges nothing into the model: every weight is bitwise what it was.
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_adapters_switched_off_sample_the_base_model(adapted, prompts, tiny_llama):
    loaded, adapters = adapted
    params = SamplingParams(max_new_tokens=12, temperature=0.0)
    with adapters.peft_model.disable_adapter():
        off = make_engine(loaded).generate(prompts, params)
    base = make_engine(tiny_llama).generate(prompts, params)
    assert [c.token_ids for c in off] == [c.token_ids for c in base]
    for a, b in zip(off, base, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=LOGPROB_TOLERANCE)
