"""The vllm engine without vllm: how vLLM-shaped outputs become Completions (finish reasons, stop
cutting, log-probs, grouping), the sampling arguments it sends, and that importing it never
imports vllm. The engine itself needs vllm and a CUDA GPU: that test is skipped here."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from rollout.engines.base import SamplingParams
from rollout.engines.vllm import (
    completions_from_outputs,
    finish_reason,
    vllm_sampling_arguments,
)

EOS = 0


# Plain stand-ins with the fields of vllm.outputs.RequestOutput / CompletionOutput / Logprob that
# the mapping reads, so the pure function is tested without vllm.
@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True


def decode(token_ids: Sequence[int]) -> str:
    """A character tokenizer: token id = code point; the eos token decodes to nothing."""
    return "".join(chr(t) for t in token_ids if t != EOS)


def sample(
    text: str,
    *,
    index: int = 0,
    reason: str = "length",
    stop_reason: int | str | None = None,
    eos: bool = False,
) -> CompletionOutput:
    """What vLLM returns for a sample whose tokens spell `text` (then eos, when it ended so):
    token_ids include every sampled token, a stop string's too; text is cut at the stop."""
    token_ids = [ord(c) for c in text] + ([EOS] if eos else [])
    logprobs = [{t: Logprob(-0.5 - i)} for i, t in enumerate(token_ids)]
    shown = text.split("###")[0] if isinstance(stop_reason, str) else text
    return CompletionOutput(index, shown, token_ids, None, logprobs, reason, stop_reason)


PARAMS = SamplingParams(max_new_tokens=16, stop=("###",), n=1)


def test_end_of_sequence_is_kept_with_its_logprob():
    out = RequestOutput("0", [5], [sample("hi", reason="stop", eos=True)])
    (completion,) = completions_from_outputs([out], PARAMS, decode=decode, version=3)
    assert completion.finish_reason == "eos"
    assert completion.token_ids == [ord("h"), ord("i"), EOS]
    assert completion.logprobs == [-0.5, -1.5, -2.5]
    assert completion.text == "hi"
    assert completion.policy_version == 3


def test_a_stop_token_id_is_an_eos_too():
    out = RequestOutput("0", [5], [sample("ok", reason="stop", stop_reason=EOS, eos=True)])
    (completion,) = completions_from_outputs([out], PARAMS, decode=decode, version=0)
    assert completion.finish_reason == "eos"


def test_stop_string_tokens_are_cut_with_their_logprobs():
    out = RequestOutput("0", [5], [sample("abc###", reason="stop", stop_reason="###")])
    (completion,) = completions_from_outputs([out], PARAMS, decode=decode, version=0)
    assert completion.finish_reason == "stop"
    assert completion.text == "abc"
    assert completion.token_ids == [ord(c) for c in "abc"]
    assert completion.logprobs == [-0.5, -1.5, -2.5]


def test_length_keeps_everything():
    out = RequestOutput("0", [5], [sample("abcd")])
    (completion,) = completions_from_outputs([out], PARAMS, decode=decode, version=0)
    assert completion.finish_reason == "length"
    assert completion.text == "abcd" and len(completion.token_ids) == len(completion.logprobs) == 4


def test_completions_come_grouped_by_prompt_in_sample_order():
    params = SamplingParams(max_new_tokens=4, n=2)
    outputs = [
        RequestOutput("0", [1], [sample("b", index=1), sample("a", index=0)]),
        RequestOutput("1", [2], [sample("c", index=0), sample("d", index=1)]),
    ]
    completions = completions_from_outputs(outputs, params, decode=decode, version=0)
    assert [(c.prompt_index, c.text) for c in completions] == [
        (0, "a"),
        (0, "b"),
        (1, "c"),
        (1, "d"),
    ]


def test_top_logprobs_are_the_most_likely_of_vllms_logprobs_cut_with_the_stop_string():
    """vLLM's logprobs = N gives each position the N most likely tokens and the sampled one
    (which may rank below them): the alternatives are the N, most likely first."""
    params = SamplingParams(max_new_tokens=16, stop=("#",), top_logprobs=2)
    assert vllm_sampling_arguments(params, 0, 0, [EOS])["logprobs"] == 2
    out = sample("ab#", reason="stop", stop_reason="#")
    out.logprobs = [
        {ord("a"): Logprob(-0.1, 1), ord("x"): Logprob(-2.5, 2)},
        {ord("b"): Logprob(-3.0, 3), ord("y"): Logprob(-0.2, 1), ord("z"): Logprob(-1.0, 2)},
        {ord("#"): Logprob(-0.3, 1), ord("b"): Logprob(-1.4, 2)},
    ]
    request = RequestOutput("0", [5], [out])
    (completion,) = completions_from_outputs([request], params, decode=decode, version=0)
    assert completion.logprobs == [-0.1, -3.0]  # the sampled tokens', as without alternatives
    assert completion.top_logprobs == [
        [(ord("a"), -0.1), (ord("x"), -2.5)],
        [(ord("y"), -0.2), (ord("z"), -1.0)],
    ]
    request = RequestOutput("0", [5], [sample("ab")])
    (plain,) = completions_from_outputs([request], PARAMS, decode=decode, version=0)
    assert plain.top_logprobs is None


def test_missing_samples_logprobs_or_an_abort_are_errors():
    with pytest.raises(RuntimeError, match="expected n = 2"):
        completions_from_outputs(
            [RequestOutput("0", [1], [sample("a")])],
            SamplingParams(max_new_tokens=4, n=2),
            decode=decode,
            version=0,
        )
    no_logprobs = sample("a")
    no_logprobs.logprobs = None
    with pytest.raises(RuntimeError, match="no log-prob"):
        completions_from_outputs(
            [RequestOutput("0", [1], [no_logprobs])], PARAMS, decode=decode, version=0
        )
    with pytest.raises(RuntimeError, match="unfinished"):
        finish_reason(sample("a", reason="abort"))


def test_sampling_arguments_give_every_prompt_and_sample_its_own_seed():
    params = SamplingParams(max_new_tokens=8, temperature=0.7, top_k=0, stop=("\n",), n=4)
    first = vllm_sampling_arguments(params, 100, 0, [2, 7])
    second = vllm_sampling_arguments(params, 100, 1, [2, 7])
    # vLLM seeds a prompt's n samples seed, seed + 1, ..., so prompts are n apart.
    assert (first["seed"], second["seed"]) == (100, 104)
    assert first["top_k"] == -1  # off
    assert first["stop_token_ids"] == [2, 7]
    assert first["logprobs"] == 0 and first["include_stop_str_in_output"] is False
    assert first["n"] == 4 and first["max_tokens"] == 8 and first["stop"] == ["\n"]
    assert vllm_sampling_arguments(SamplingParams(max_new_tokens=1), 0, 0, [2])["stop"] is None


def test_importing_the_engine_module_does_not_import_vllm():
    script = "import sys, rollout.engines.vllm; print('vllm' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    assert result.stdout.strip() == "False"


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.gpu
def test_vllm_engine_generates_and_takes_new_weights(rollout_cache, tiny_llama):
    """On a CUDA machine with vllm: greedy tokens, grouping, and an in-place weight update."""
    pytest.importorskip("vllm", reason="needs vllm: pip install 'rollout[vllm]' (CUDA only)")
    if not _cuda():
        pytest.skip("needs a CUDA GPU")
    import torch

    from rollout.engines.vllm import VllmEngine
    from rollout.models.builtin_build import builtin_model_dir
    from rollout.models.loading import apply_chat_template

    engine = VllmEngine(
        str(builtin_model_dir("tiny-llama")),
        eos_token_ids=tiny_llama.eos_token_ids,
        dtype="float32",
        seed=0,
        gpu_memory_utilization=0.2,
        enforce_eager=True,
    )
    try:
        prompt = apply_chat_template(tiny_llama.tokenizer, tiny_llama.chat_template, "Hi", None)
        greedy = SamplingParams(max_new_tokens=8, temperature=0.0, n=2)
        first = engine.generate([prompt, prompt], greedy)
        assert [c.prompt_index for c in first] == [0, 0, 1, 1]
        assert all(len(c.token_ids) == len(c.logprobs) > 0 for c in first)
        changed = {k: torch.randn_like(v) for k, v in tiny_llama.model.state_dict().items()}
        engine.load_weights(changed, version=5)
        second = engine.generate([prompt], greedy)
        assert second[0].policy_version == 5
        assert second[0].token_ids != first[0].token_ids
    finally:
        engine.close()
