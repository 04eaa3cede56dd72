"""Agents over the OpenAI endpoint: an episode's base URL (`/episodes/{id}/v1`) serves the same
API, and the server's CompletionRecorder holds exactly the tokens and log-probs it served there.
Real HTTP on loopback, the real `openai` client, the tiny model."""

from __future__ import annotations

import http.client
import json
import threading
from pathlib import Path

import openai
import pytest

from rollout.inference.serve_source import load_served, resolve_source
from rollout.serve.recording import CompletionRecorder
from rollout.serve.server import OpenAIServer

MODEL = "tiny-llama"
WAIT_S = 60


@pytest.fixture(scope="module")
def tiny(rollout_cache):
    from rollout.config.model import ModelSection
    from rollout.models.loading import load_model
    from rollout.planner.inspect_model import inspect_model

    section = ModelSection(builtin=MODEL)
    facts = inspect_model(section, base_dir=Path.cwd())
    return load_model(facts, section, dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def server(rollout_cache):
    source = resolve_source(config=None, model=f"builtin:{MODEL}", checkpoint=None, name=None)
    served = load_served(source, device="cpu", dtype="auto", seed=0, max_batch_size=8)
    running = OpenAIServer(("127.0.0.1", 0), served, api_key=None, recorder=CompletionRecorder())
    thread = threading.Thread(target=running.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    yield running
    running.stop()
    thread.join(WAIT_S)


def agent(server, episode: str) -> openai.OpenAI:
    url = server.episode_url(episode)
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=WAIT_S)


def raw(server, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    host, port = server.server_address[:2]
    connection = http.client.HTTPConnection(host, port, timeout=WAIT_S)
    try:
        connection.request(method, path, body=None if body is None else json.dumps(body))
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def test_an_agent_on_an_episode_url_gets_answers_and_every_completion_is_recorded(server, tiny):
    from rollout.models.loading import apply_chat_template

    recorder = server.recorder
    client = agent(server, "episode-1")
    assert [m.id for m in client.models.list().data] == [MODEL]
    messages = [{"role": "user", "content": "Hi"}]
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=1.0, logprobs=True, seed=1
    )
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=5, stream=True, seed=2
        )
    )
    completions = client.completions.create(model=MODEL, prompt="Go", max_tokens=4, n=2, seed=3)
    # Another episode and the plain route are served too, and kept apart.
    agent(server, "episode-2").completions.create(model=MODEL, prompt="Other", max_tokens=3)
    plain = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=WAIT_S)
    plain.completions.create(model=MODEL, prompt="Unrecorded", max_tokens=3)

    recorded = recorder.drain("episode-1")
    assert [r.kind for r in recorded] == ["chat", "chat", "completion", "completion"]
    assert {r.episode_id for r in recorded} == {"episode-1"}

    # The chat answer: the agent's text and log-probs are exactly the recorded tokens'.
    first = recorded[0]
    (choice,) = chat.choices
    assert first.prompt_token_ids == apply_chat_template(
        tiny.tokenizer, tiny.chat_template, "Hi", None
    )
    assert (
        tiny.tokenizer.decode(first.token_ids, skip_special_tokens=True) == choice.message.content
    )
    assert first.logprobs == [t.logprob for t in choice.logprobs.content]
    assert len(first.token_ids) == len(first.logprobs) == chat.usage.completion_tokens
    assert first.policy_version == 0
    assert first.finish_reason == choice.model_extra["rollout"]["finish_reason"]
    # As text too, for the run report: what the agent sent and the reply it read.
    assert first.sent == ({"role": "user", "content": "Hi"},)
    assert first.text == choice.message.content

    # The stream: the text the agent read, token by token, and the extension's last chunk.
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert tiny.tokenizer.decode(recorded[1].token_ids, skip_special_tokens=True) == streamed
    assert recorded[1].text == streamed
    extension = [
        c.choices[0].model_extra["rollout"]
        for c in chunks
        if c.choices and c.choices[0].model_extra.get("rollout")
    ]
    assert extension[0]["token_ids"] == recorded[1].token_ids
    assert extension[0]["logprobs"] == recorded[1].logprobs

    # n=2: both samples, each as served.
    served = sorted(
        (c.model_extra["rollout"]["token_ids"], c.model_extra["rollout"]["logprobs"])
        for c in completions.choices
    )
    assert sorted((r.token_ids, r.logprobs) for r in recorded[2:]) == served
    assert recorded[2].prompt_token_ids == tiny.tokenizer.encode("Go")
    assert recorded[2].sent == recorded[3].sent == ({"role": "prompt", "content": "Go"},)
    assert sorted(r.text for r in recorded[2:]) == sorted(c.text for c in completions.choices)

    assert [len(recorder.drain("episode-2")), recorder.drain("episode-1")] == [1, []]
    assert len(recorder) == 0 and recorder.episodes() == []


@pytest.mark.parametrize(
    ("path", "status"),
    [
        ("/episodes/e1/v1/models", 200),
        ("/episodes/e1/v1/nothing", 404),
        ("/episodes/e1", 404),
        ("/episodes/../v1/models", 404),
        ("/episodes/" + "a" * 129 + "/v1/models", 404),
        ("/episodes//v1/models", 404),
    ],
)
def test_episode_paths(server, path, status):
    got, body = raw(server, "GET", path)
    assert got == status, body
    if status != 200:
        assert set(body["error"]) == {"message", "type", "param", "code"}


def test_a_full_recorder_refuses_episode_requests_but_not_plain_ones(server):
    recorder = server.recorder
    request = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    assert raw(server, "POST", "/episodes/e3/v1/completions", request)[0] == 200
    bound = recorder.max_completions
    recorder.max_completions = len(recorder)
    try:
        status, body = raw(server, "POST", "/episodes/e3/v1/completions", request)
        assert status == 503 and "drain" in body["error"]["message"]
        assert raw(server, "POST", "/v1/completions", request)[0] == 200
    finally:
        recorder.max_completions = bound
    assert len(recorder.drain("e3")) == 1


def test_without_a_recorder_episode_routes_are_404_not_served_unrecorded(server):
    recorder, server.recorder = server.recorder, None
    try:
        status, body = raw(server, "GET", "/episodes/e4/v1/models")
        assert status == 404 and "recorder" in body["error"]["message"]
    finally:
        server.recorder = recorder
