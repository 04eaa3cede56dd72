"""The engine service, with real threads on the tiny model: concurrent requests join one batch
and get what they would get alone, events add up to the completions, cancelling frees the
batch, close() finishes what is in flight."""

from __future__ import annotations

import threading
import time

import pytest

from rollout.engines.base import SamplingParams
from rollout.engines.hf.engine import HfEngine
from rollout.engines.service import (
    EngineService,
    RequestCancelled,
    ServiceBusy,
    ServiceClosed,
    merge_events,
    releasable,
)
from rollout.models.loading import apply_chat_template

QUESTIONS = ("What is 2 + 3?", "Hi", "Name a color.", "Compute 12 * 7 - 7, step by step.")
WAIT_S = 60


@pytest.fixture(scope="module")
def prompts(tiny_llama) -> list[list[int]]:
    return [
        apply_chat_template(tiny_llama.tokenizer, tiny_llama.chat_template, q, None)
        for q in QUESTIONS
    ]


def make_engine(loaded, **overrides) -> HfEngine:
    arguments = {
        "eos_token_ids": loaded.eos_token_ids,
        "pad_token_id": loaded.pad_token_id,
        "tokenizer": loaded.tokenizer,
        "seed": 0,
    }
    return HfEngine(loaded.model, **{**arguments, **overrides})


def greedy(max_new_tokens: int = 24, **kwargs) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, **kwargs)


@pytest.fixture
def service(tiny_llama):
    with EngineService(make_engine(tiny_llama), max_batch_size=8) as running:
        yield running


def test_concurrent_clients_share_one_batch_and_get_what_they_get_alone(
    tiny_llama, service, prompts
):
    expected = make_engine(tiny_llama).generate(prompts, greedy(64))
    barrier = threading.Barrier(len(prompts))
    results: dict[int, list] = {}

    def client(index: int) -> None:
        barrier.wait()  # all submit at once, while the others are being sampled
        results[index] = service.submit(prompts[index], greedy(64)).result(timeout=WAIT_S)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_S)
    assert service.stats.extra["max_live_rows"] == len(prompts)
    for index, reference in enumerate(expected):
        (completion,) = results[index]
        assert completion.token_ids == reference.token_ids
        assert completion.logprobs == pytest.approx(reference.logprobs, abs=1e-5)
        assert completion.text == reference.text


def test_events_add_up_to_the_completions(service, prompts):
    handle = service.submit(prompts[0], SamplingParams(max_new_tokens=20, n=3, seed=4))
    texts, tokens, logprobs, reasons = [""] * 3, [[], [], []], [[], [], []], [None] * 3
    for event in handle.events(timeout=WAIT_S):
        assert reasons[event.sample] is None, "an event after the sample's last"
        texts[event.sample] += event.text
        tokens[event.sample] += event.token_ids
        logprobs[event.sample] += event.logprobs
        reasons[event.sample] = event.finish_reason
    completions = handle.result(timeout=WAIT_S)
    assert len(completions) == 3
    for sample, completion in enumerate(completions):
        assert texts[sample] == completion.text
        assert tokens[sample] == completion.token_ids
        assert logprobs[sample] == completion.logprobs
        assert reasons[sample] == completion.finish_reason
    assert len({tuple(c.token_ids) for c in completions}) > 1  # independent samples


def test_prompts_submitted_together_stream_as_their_tokens_come(service, prompts):
    """A short request after a long one is not held up: its events, its end included, come
    while the long one is still being sampled, and each adds up to its own completions."""
    handles = service.submit_many(prompts[:2], [greedy(40), greedy(3, n=2)])
    with pytest.raises(ValueError, match="merge_events"):
        next(handles[0].events())
    order, texts, tokens = [], {}, {}
    for number, event in merge_events(handles, timeout=WAIT_S):
        order.append((number, event.finish_reason is not None))
        key = (number, event.sample)
        texts[key] = texts.get(key, "") + event.text
        tokens[key] = tokens.get(key, []) + event.token_ids
    short_done = max(i for i, (number, last) in enumerate(order) if number == 1 and last)
    long_done = max(i for i, (number, _) in enumerate(order) if number == 0)
    assert short_done < long_done
    for number, handle in enumerate(handles):
        for sample, completion in enumerate(handle.result(timeout=WAIT_S)):
            assert texts[number, sample] == completion.text
            assert tokens[number, sample] == completion.token_ids


def test_events_carry_each_tokens_alternatives(service, prompts):
    handle = service.submit(prompts[0], SamplingParams(max_new_tokens=12, seed=3, top_logprobs=4))
    alternatives: list = []
    for event in handle.events(timeout=WAIT_S):
        assert len(event.top_logprobs) == len(event.token_ids)
        alternatives += event.top_logprobs
    (completion,) = handle.result()
    assert alternatives == completion.top_logprobs
    assert all(len(a) == 4 for a in alternatives)
    (plain,) = service.submit(prompts[0], greedy(4)).result(timeout=WAIT_S)
    assert plain.top_logprobs is None


def test_stop_strings_never_reach_the_stream(tiny_llama, service, prompts):
    (full,) = make_engine(tiny_llama).generate(prompts[:1], greedy(24))
    decode = tiny_llama.tokenizer.decode
    stop = next(
        decode(full.token_ids[i : i + 2])
        for i in range(3, len(full.token_ids) - 2)
        if decode(full.token_ids[i : i + 2]).strip()
        and full.text.find(decode(full.token_ids[i : i + 2])) == len(decode(full.token_ids[:i]))
    )
    handle = service.submit(prompts[0], greedy(24, stop=(stop,)))
    streamed = "".join(event.text for event in handle.events(timeout=WAIT_S))
    (completion,) = handle.result()
    assert completion.finish_reason == "stop"
    assert streamed == completion.text == full.text[: full.text.find(stop)]


def test_releasable_holds_back_what_may_become_a_stop_string():
    assert releasable("The answer is 4", ("\n\n", "is 42")) == "The answer "
    assert releasable("The answer is 42 and", ("is 42",)) == "The answer "
    assert releasable("ends with a newline\n", ("\n\n",)) == "ends with a newline"
    assert releasable("half a character \ufffd", ()) == "half a character "
    assert releasable("nothing to hold", ("STOP",)) == "nothing to hold"


def test_a_cancelled_request_leaves_the_batch_and_others_go_on(service, prompts):
    long = service.submit(prompts[0], greedy(900))
    next(iter(long.events(timeout=WAIT_S)))  # it is being sampled
    long.cancel()
    with pytest.raises(RequestCancelled):
        long.result(timeout=WAIT_S)
    (short,) = service.submit(prompts[1], greedy(8)).result(timeout=WAIT_S)
    assert len(short.token_ids) == 8
    # The cancelled row stopped well before its 900 tokens.
    assert service.stats.generated_tokens < 900


def test_close_finishes_requests_in_flight_and_refuses_new_ones(tiny_llama, prompts):
    service = EngineService(make_engine(tiny_llama))
    handles = [service.submit(prompt, greedy(48)) for prompt in prompts]
    service.close(timeout=WAIT_S)
    for handle in handles:
        (completion,) = handle.result(timeout=0)
        assert len(completion.token_ids) == 48
    with pytest.raises(ServiceClosed):
        service.submit(prompts[0], greedy(4))


def test_too_many_requests_are_refused(tiny_llama, prompts):
    with EngineService(make_engine(tiny_llama), max_requests=2) as service:
        with pytest.raises(ServiceBusy):  # all of them or none
            service.submit_many([prompts[0]] * 3, [greedy(4)] * 3)
        first = [service.submit(prompts[0], greedy(200)) for _ in range(2)]
        with pytest.raises(ServiceBusy):
            service.submit(prompts[0], greedy(4))
        for handle in first:
            handle.result(timeout=WAIT_S)
        assert service.submit(prompts[0], greedy(4)).result(timeout=WAIT_S)


def test_an_empty_prompt_is_refused(service):
    with pytest.raises(ValueError, match="no tokens"):
        service.submit([], greedy(4))


def test_occupancy_counts_the_rows_sampled_together(service, prompts):
    """What /metrics shows as the batch's occupancy: the rows of the last step, of the cap."""
    assert service.occupancy == (0, 8)
    handle = service.submit(prompts[0], SamplingParams(max_new_tokens=20, n=3, seed=4))
    seen = [service.occupancy[0] for _ in handle.events(timeout=WAIT_S)]
    assert max(seen) == 3  # the three samples of the prompt, decoded together
    deadline = time.monotonic() + WAIT_S
    while service.occupancy[0] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert service.occupancy == (0, 8)  # idle again once the step after the last row ends
