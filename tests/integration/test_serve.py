"""`rollout serve` over real HTTP on loopback, driven by the real `openai` client, on the tiny
model: the routes, streaming, n, stop strings, logprobs and their alternatives, the `rollout`
extension, batching of concurrent clients, the API key, TLS, bad input, graceful shutdown of the
real CLI process, and a trained run served by its id."""

from __future__ import annotations

import datetime
import http.client
import ipaddress
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import threading
from pathlib import Path

import openai
import pytest
from typer.testing import CliRunner

from rollout.cli.app import app
from rollout.errors import RolloutError
from rollout.inference.serve_source import load_served, resolve_source
from rollout.serve.loading import tls_context
from rollout.serve.server import OpenAIServer

# test_run_grpo's run-making helpers and its workdir fixture (a copy of examples/).
from tests.integration.driver import environment, only_run, rollout

MODEL = "tiny-llama"
WAIT_S = 60


@pytest.fixture(scope="module")
def tiny(rollout_cache):
    """The model as the server loads it, for expected token ids."""
    from rollout.config.model import ModelSection
    from rollout.models.loading import load_model
    from rollout.planner.inspect_model import inspect_model

    section = ModelSection(builtin=MODEL)
    facts = inspect_model(section, base_dir=Path.cwd())
    return load_model(facts, section, dtype="float32", device="cpu")


def start(host: str = "127.0.0.1", api_key: str | None = None, tls: ssl.SSLContext | None = None):
    source = resolve_source(config=None, model=f"builtin:{MODEL}", checkpoint=None, name=None)
    served = load_served(source, device="cpu", dtype="auto", seed=0, max_batch_size=8)
    server = OpenAIServer((host, 0), served, api_key=api_key, tls=tls)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    return server, thread


@pytest.fixture(scope="module")
def server(rollout_cache):
    running, thread = start()
    yield running
    running.stop()
    thread.join(WAIT_S)


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=WAIT_S)


def chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def raw(server, method: str, path: str, body: bytes | None = None, headers=None):
    """One request on a fresh connection: (status, parsed JSON body)."""
    host, port = server.server_address[:2]
    connection = http.client.HTTPConnection(host, port, timeout=WAIT_S)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def test_models_list(client):
    (model,) = client.models.list().data
    assert model.id == MODEL and model.owned_by == "rollout"


def test_completion_and_its_rollout_fields(client, tiny):
    response = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0, logprobs=1
    )
    (choice,) = response.choices
    extension = choice.model_extra["rollout"]
    prompt_ids = tiny.tokenizer.encode("The capital of France is")
    assert extension["prompt_token_ids"] == prompt_ids
    assert len(extension["token_ids"]) == len(extension["logprobs"]) == 12
    assert extension["policy_version"] == 0 and extension["finish_reason"] == "length"
    assert choice.text == tiny.tokenizer.decode(extension["token_ids"], skip_special_tokens=True)
    assert choice.logprobs.token_logprobs == extension["logprobs"]
    assert len(choice.logprobs.tokens) == 12
    assert response.usage.prompt_tokens == len(prompt_ids)
    assert response.usage.completion_tokens == 12


def test_chat_applies_the_template(client, tiny):
    from rollout.models.loading import apply_chat_template

    response = client.chat.completions.create(
        model=MODEL, messages=chat("Hi"), max_tokens=8, temperature=0, logprobs=True
    )
    (choice,) = response.choices
    expected_prompt = apply_chat_template(tiny.tokenizer, tiny.chat_template, "Hi", None)
    assert choice.model_extra["rollout"]["prompt_token_ids"] == expected_prompt
    assert choice.message.role == "assistant"
    assert [t.logprob for t in choice.logprobs.content] == choice.model_extra["rollout"]["logprobs"]


def expected_top(tiny, prompt_ids: list[int], token_ids: list[int], count: int):
    """What the alternatives must be: log_softmax(logits)(T = 1, greedy) of one forward over
    prompt + completion, top `count` at each completion position, as (texts, log-probs)."""
    import torch

    with torch.no_grad():
        logits = tiny.model(input_ids=torch.tensor([prompt_ids + token_ids])).logits[0].float()
    start = len(prompt_ids) - 1
    top = logits[start : start + len(token_ids)].log_softmax(-1).topk(count)
    texts = [[tiny.tokenizer.decode([t]) for t in row] for row in top.indices.tolist()]
    return texts, top.values.tolist()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_top_logprobs_list_the_most_likely_tokens(client, tiny, stream):
    arguments = {"model": MODEL, "messages": chat("Hi"), "max_tokens": 6, "temperature": 0}
    whole = client.chat.completions.create(logprobs=True, top_logprobs=3, **arguments)
    (choice,) = whole.choices
    extension = choice.model_extra["rollout"]
    texts, values = expected_top(tiny, extension["prompt_token_ids"], extension["token_ids"], 3)
    content = choice.logprobs.content
    assert len(content) == len(extension["token_ids"]) == 6
    for token, expected_texts, expected_values in zip(content, texts, values, strict=True):
        assert [t.token for t in token.top_logprobs] == expected_texts
        assert [t.logprob for t in token.top_logprobs] == pytest.approx(expected_values, abs=1e-4)
        assert token.top_logprobs[0].logprob == token.logprob  # greedy: the sampled one is first
        assert all(t.bytes == list(t.token.encode()) for t in token.top_logprobs)
    if stream:
        chunks = client.chat.completions.create(
            logprobs=True, top_logprobs=3, stream=True, **arguments
        )
        streamed = [
            t
            for c in chunks
            if c.choices and c.choices[0].logprobs
            for t in c.choices[0].logprobs.content
        ]
        assert [t.model_dump() for t in streamed] == [t.model_dump() for t in content]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_completion_logprobs_n_map_the_alternatives_texts(client, tiny, stream):
    arguments = {"model": MODEL, "prompt": "Once upon", "max_tokens": 5, "temperature": 0}
    whole = client.completions.create(logprobs=2, **arguments)
    (choice,) = whole.choices
    extension = choice.model_extra["rollout"]
    texts, values = expected_top(tiny, extension["prompt_token_ids"], extension["token_ids"], 2)
    tops = choice.logprobs.top_logprobs
    assert len(tops) == 5
    for top, token, logprob, expected_texts, expected_values in zip(
        tops, choice.logprobs.tokens, choice.logprobs.token_logprobs, texts, values, strict=True
    ):
        assert list(top) == expected_texts  # most likely first; greedy: the sampled token's
        assert list(top.values()) == pytest.approx(expected_values, abs=1e-4)
        assert top[token] == logprob
    if stream:
        chunks = client.completions.create(logprobs=2, stream=True, **arguments)
        streamed = [
            t
            for c in chunks
            if c.choices and c.choices[0].logprobs
            for t in c.choices[0].logprobs.top_logprobs
        ]
        assert streamed == tops


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("chat", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ("chat", {"logprobs": True, "top_logprobs": "3"}, "top_logprobs"),
        ("chat", {"top_logprobs": 2}, "top_logprobs"),
        ("chat", {"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
        ("completions", {"logprobs": 6}, "logprobs"),
        ("completions", {"logprobs": True}, "logprobs"),
    ],
    ids=["over-20", "negative", "a-string", "without-logprobs", "logprobs-false", "over-5", "bool"],
)
def test_bad_top_logprobs_get_a_400(server, route, body, param):
    if route == "chat":
        path, body = "/v1/chat/completions", {"model": MODEL, "messages": chat("x"), **body}
    else:
        path, body = "/v1/completions", {"model": MODEL, "prompt": "x", **body}
    status, error = raw(server, "POST", path, json.dumps(body).encode())
    assert status == 400 and error["error"]["param"] == param


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_streaming_ends_with_done_and_adds_up_to_the_non_streamed_text(server, client, kind):
    arguments = {"model": MODEL, "max_tokens": 20, "temperature": 0}
    if kind == "chat":
        whole = client.chat.completions.create(messages=chat("Tell me"), **arguments)
        stream = client.chat.completions.create(messages=chat("Tell me"), stream=True, **arguments)
        deltas = [c.choices[0].delta.content or "" for c in stream if c.choices]
        assert "".join(deltas) == whole.choices[0].message.content
        path, body = "/v1/chat/completions", {"messages": chat("Tell me"), **arguments}
    else:
        whole = client.completions.create(prompt="Once upon", **arguments)
        stream = client.completions.create(prompt="Once upon", stream=True, **arguments)
        deltas = [c.choices[0].text for c in stream if c.choices]
        assert "".join(deltas) == whole.choices[0].text
        path, body = "/v1/completions", {"prompt": "Once upon", **arguments}
    # The wire itself: server-sent events, the last one [DONE].
    host, port = server.server_address[:2]
    connection = http.client.HTTPConnection(host, port, timeout=WAIT_S)
    connection.request("POST", path, body=json.dumps({**body, "stream": True}))
    response = connection.getresponse()
    assert response.getheader("Content-Type") == "text/event-stream"
    events = [line for line in response.read().decode().split("\n") if line]
    connection.close()
    assert all(line.startswith("data: ") for line in events)
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2].removeprefix("data: "))
    assert last["choices"][0]["finish_reason"] == "length"
    assert (
        last["choices"][0]["rollout"]["token_ids"]
        == (whole.choices[0].model_extra["rollout"]["token_ids"])
    )


def test_a_multi_prompt_stream_interleaves_the_prompts(client):
    """Prompt 1 stops early (a stop string) while prompt 0 runs 40 tokens: prompt 1's end is
    streamed before prompt 0's, not after it, and each choice adds up to the non-streamed one.
    Greedy, so that neither prompt's text depends on when the other one ends."""
    arguments = {"model": MODEL, "prompt": ["Once upon a time", "Count"], "max_tokens": 40}
    arguments["temperature"] = 0
    free = sorted(client.completions.create(**arguments).choices, key=lambda c: c.index)
    long_text, short_text = free[0].text, free[1].text
    stop = next(
        short_text[i : i + 2]
        for i in range(1, 12)
        if short_text[i : i + 2].strip()
        and short_text.find(short_text[i : i + 2]) == i
        and short_text[i : i + 2] not in long_text
    )
    whole = sorted(client.completions.create(stop=stop, **arguments).choices, key=lambda c: c.index)
    assert [c.finish_reason for c in whole] == ["length", "stop"]
    assert whole[1].text == short_text[: short_text.find(stop)]
    chunks = [
        c for c in client.completions.create(stop=stop, stream=True, **arguments) if c.choices
    ]
    short_end = next(
        at
        for at, c in enumerate(chunks)
        if c.choices[0].index == 1 and c.choices[0].finish_reason is not None
    )
    long_last = max(at for at, c in enumerate(chunks) if c.choices[0].index == 0)
    assert short_end < long_last
    for choice in whole:
        texts = [c.choices[0].text for c in chunks if c.choices[0].index == choice.index]
        assert "".join(texts) == choice.text


def test_n_completions(client):
    response = client.chat.completions.create(
        model=MODEL, messages=chat("Hi"), max_tokens=10, temperature=1.0, n=3, seed=5
    )
    assert [choice.index for choice in response.choices] == [0, 1, 2]
    assert len({tuple(c.model_extra["rollout"]["token_ids"]) for c in response.choices}) > 1
    assert response.usage.completion_tokens == sum(
        len(c.model_extra["rollout"]["token_ids"]) for c in response.choices
    )


def test_stop_strings(client):
    full = client.completions.create(model=MODEL, prompt="Numbers:", max_tokens=24, temperature=0)
    text = full.choices[0].text
    stop = next(text[i : i + 2] for i in range(4, len(text) - 2) if text[i : i + 2].strip())
    cut = client.completions.create(
        model=MODEL, prompt="Numbers:", max_tokens=24, temperature=0, stop=[stop]
    )
    (choice,) = cut.choices
    assert choice.text == text[: text.find(stop)]
    assert choice.finish_reason == "stop"
    assert choice.model_extra["rollout"]["finish_reason"] == "stop"
    streamed = client.completions.create(
        model=MODEL, prompt="Numbers:", max_tokens=24, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == choice.text


def test_concurrent_clients_are_batched_together(server, client):
    stats = server.model.service.stats
    stats.extra["max_live_rows"] = 0
    barrier = threading.Barrier(4)
    texts: dict[int, str] = {}

    def ask(index: int) -> None:
        barrier.wait()
        response = client.completions.create(
            model=MODEL, prompt=f"Client {index} says", max_tokens=64, temperature=0
        )
        texts[index] = response.choices[0].text

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_S)
    assert len(texts) == 4
    assert stats.extra["max_live_rows"] == 4


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b"{not json", 400, None),
        (b"[1, 2]", 400, None),
        (json.dumps({"model": "gpt-4", "prompt": "x"}).encode(), 404, "model"),
        (json.dumps({"model": MODEL, "prompt": 3}).encode(), 400, "prompt"),
        (
            json.dumps({"model": MODEL, "prompt": "x", "max_tokens": "5"}).encode(),
            400,
            "max_tokens",
        ),
        (json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 0}).encode(), 400, "max_tokens"),
        (json.dumps({"model": MODEL, "prompt": "x", "n": 0}).encode(), 400, "n"),
        (json.dumps({"model": MODEL, "prompt": "x", "n": 1000}).encode(), 400, "n"),
        (
            json.dumps({"model": MODEL, "prompt": "x", "temperature": -1}).encode(),
            400,
            "temperature",
        ),
        (json.dumps({"model": MODEL, "prompt": "x", "stop": [1]}).encode(), 400, "stop"),
        (json.dumps({"model": MODEL, "prompt": [[1, 99999]]}).encode(), 400, "prompt"),
        (
            json.dumps({"model": MODEL, "prompt": "word " * 2000, "max_tokens": 4}).encode(),
            400,
            "prompt",
        ),
    ],
    ids=[
        "malformed-json",
        "not-an-object",
        "unknown-model",
        "prompt-type",
        "max_tokens-type",
        "max_tokens-zero",
        "n-zero",
        "n-too-many",
        "temperature",
        "stop-type",
        "token-out-of-vocab",
        "prompt-over-context",
    ],
)
def test_bad_input_gets_a_4xx_and_the_server_goes_on(server, client, body, status, param):
    got, error = raw(server, "POST", "/v1/completions", body, {"Content-Type": "application/json"})
    assert got == status
    assert set(error["error"]) == {"message", "type", "param", "code"}
    assert error["error"]["param"] == param
    assert client.completions.create(model=MODEL, prompt="still", max_tokens=2).choices


def test_bad_chat_messages_and_routes(server):
    status, error = raw(
        server,
        "POST",
        "/v1/chat/completions",
        json.dumps({"model": MODEL, "messages": []}).encode(),
    )
    assert status == 400 and error["error"]["param"] == "messages"
    status, error = raw(
        server,
        "POST",
        "/v1/chat/completions",
        json.dumps({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}).encode(),
    )
    assert status == 400 and error["error"]["param"] == "messages[0].role"
    assert raw(server, "GET", "/v1/nothing")[0] == 404
    assert raw(server, "GET", "/v1/completions")[0] == 405


def test_the_api_key_is_required_on_every_route_off_loopback(rollout_cache):
    server, thread = start(host="0.0.0.0", api_key="s3cret")
    try:
        url = server.url.replace("0.0.0.0", "127.0.0.1")
        for key in ("wrong", ""):
            anonymous = openai.OpenAI(base_url=url, api_key=key or "x", max_retries=0)
            with pytest.raises(openai.AuthenticationError):
                anonymous.models.list()
            with pytest.raises(openai.AuthenticationError):
                anonymous.completions.create(model=MODEL, prompt="x", max_tokens=2)
        status, error = raw(server, "GET", "/v1/models")
        assert status == 401 and error["error"]["code"] == "invalid_api_key"
        allowed = openai.OpenAI(base_url=url, api_key="s3cret", max_retries=0)
        assert allowed.completions.create(model=MODEL, prompt="x", max_tokens=2).choices
    finally:
        server.stop()
        thread.join(WAIT_S)


def self_signed_certificate(directory: Path, name: str = "server") -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key, as PEM files: made with the cryptography package,
    else the openssl command (the test is skipped without either)."""
    cert, key = directory / f"{name}.crt", directory / f"{name}.key"
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        if shutil.which("openssl") is None:
            pytest.skip("needs the cryptography package or the openssl command")
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
             "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
             "-keyout", str(key), "-out", str(cert)],
            check=True, capture_output=True,
        )  # fmt: skip
        return cert, key
    private = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(private.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.SubjectKeyIdentifier.from_public_key(private.public_key()), critical=False
        )
        .sign(private, hashes.SHA256())
    )
    cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key.write_bytes(
        private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert, key


def trusting(cert: Path, url: str) -> openai.OpenAI:
    """An OpenAI client that trusts `cert` (and nothing else)."""
    http_client = openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=str(cert)))
    return openai.OpenAI(
        base_url=url, api_key="x", max_retries=0, timeout=WAIT_S, http_client=http_client
    )


def test_tls_serves_https_to_clients_that_trust_the_certificate(rollout_cache, tmp_path):
    cert, key = self_signed_certificate(tmp_path)
    server, thread = start(tls=tls_context(cert, key))
    try:
        assert server.url.startswith("https://127.0.0.1:")
        client = trusting(cert, server.url)
        response = client.completions.create(model=MODEL, prompt="x", max_tokens=4, temperature=0)
        assert len(response.choices[0].model_extra["rollout"]["token_ids"]) == 4
        stream = client.chat.completions.create(
            model=MODEL, messages=chat("Hi"), max_tokens=4, temperature=0, stream=True
        )
        assert [c for c in stream if c.choices and c.choices[0].finish_reason]
        # A client that does not trust the certificate, or speaks plain HTTP, gets nowhere...
        other, _ = self_signed_certificate(tmp_path, "other")
        with pytest.raises(openai.APIConnectionError):
            trusting(other, server.url).models.list()
        with pytest.raises((http.client.HTTPException, OSError)):
            raw(server, "GET", "/v1/models")
        # ...and the server goes on.
        assert client.models.list().data[0].id == MODEL
        # A client that goes away over TLS has its request cancelled too.
        trust = ssl.create_default_context(cafile=str(cert))
        for stream in (False, True):
            assert tokens_sampled_for_a_client_that_leaves(server, stream=stream, tls=trust) < 1000
    finally:
        server.stop()
        thread.join(WAIT_S)


def test_the_cli_refuses_bad_tls_files_with_one_clear_error(tmp_path):
    cert, key = self_signed_certificate(tmp_path)
    _, other_key = self_signed_certificate(tmp_path, "other")
    serve = ["serve", "--model", "builtin:tiny-llama"]
    cases = [
        (["--tls-cert", str(cert)], "--tls-key"),
        (["--tls-key", str(key)], "--tls-cert"),
        (["--tls-cert", str(tmp_path / "missing.crt"), "--tls-key", str(key)], "cannot read"),
        (["--tls-cert", str(key), "--tls-key", str(key)], "no PEM certificate"),
        (["--tls-cert", str(cert), "--tls-key", str(cert)], "no PEM private key"),
        (["--tls-cert", str(cert), "--tls-key", str(other_key)], "not the private key"),
    ]
    for arguments, message in cases:
        result = CliRunner().invoke(app, [*serve, *arguments])
        assert result.exit_code == 2, result.output
        assert message in result.output and "Traceback" not in result.output
    # TLS is no substitute for the API key off loopback.
    result = CliRunner().invoke(
        app, [*serve, "--host", "0.0.0.0", "--tls-cert", str(cert), "--tls-key", str(key)]
    )
    assert result.exit_code == 2 and "API key" in result.output


def test_the_cli_refuses_a_public_address_without_a_key_and_a_literal_key():
    runner = CliRunner()
    result = runner.invoke(app, ["serve", "--model", "builtin:tiny-llama", "--host", "0.0.0.0"])
    assert result.exit_code == 2
    assert "API key" in result.output
    result = runner.invoke(
        app, ["serve", "--model", "builtin:tiny-llama", "--host", "0.0.0.0", "--api-key", "hunter2"]
    )
    assert result.exit_code == 2
    assert "hunter2" not in result.output
    result = runner.invoke(app, ["serve", "--model", "builtin:tiny-llama", "--config", "x.toml"])
    assert result.exit_code == 2 and "exactly one" in result.output


def test_sigterm_finishes_the_request_in_flight(rollout_cache):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "rollout", "serve", "--model", "builtin:tiny-llama", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        line = ""
        while "serving" not in line:
            line = process.stdout.readline()
            assert line, "the server exited before serving"
        url = line.split(" at ")[1].split()[0]
        host, port = url.removeprefix("http://").removesuffix("/v1").split(":")
        connection = http.client.HTTPConnection(host, int(port), timeout=WAIT_S)
        body = {
            "model": MODEL,
            "prompt": "Go",
            "max_tokens": 1000,
            "temperature": 0,
            "stream": True,
        }
        connection.request("POST", "/v1/completions", body=json.dumps(body))
        response = connection.getresponse()
        first = response.readline()  # the stream has started
        assert first
        process.send_signal(signal.SIGTERM)
        events = [line for line in (first + response.read()).decode().split("\n") if line]
        assert events[-1] == "data: [DONE]"
        last = json.loads(events[-2].removeprefix("data: "))
        assert len(last["choices"][0]["rollout"]["token_ids"]) == 1000
        assert process.wait(WAIT_S) == 0
    finally:
        if process.poll() is None:
            process.kill()


def test_a_config_gives_the_model_and_the_request_defaults(config_file, base_config):
    base_config["generation"].update(max_new_tokens=7, temperature=0.5, stop=["\n\n"])
    source = resolve_source(config=config_file(base_config), model=None, checkpoint=None, name=None)
    assert source.section.builtin == MODEL and source.name == MODEL
    assert (source.defaults.max_tokens, source.defaults.temperature) == (7, 0.5)
    assert source.defaults.stop == ("\n\n",)


def test_a_checkpoint_is_served_with_its_step_as_policy_version(tiny, tmp_path):
    from rollout.runtime.checkpoint import save_checkpoint

    root = tmp_path / "runs" / "demo" / "checkpoints"
    for step in (2, 3):
        save_checkpoint(
            root,
            step,
            model=tiny.model,
            tokenizer=tiny.tokenizer,
            optimizer=None,
            scheduler=None,
            trainer_state={},
            keep_last=2,
        )
    source = resolve_source(
        config=None, model=None, checkpoint=str(root.parent), name=None
    )  # a run directory: its latest step
    assert source.name == "demo/step-000003" and source.policy_version == 3
    served = load_served(source, device="cpu", dtype="auto", seed=0, max_batch_size=None)
    server = OpenAIServer(("127.0.0.1", 0), served, api_key=None)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        client = openai.OpenAI(base_url=server.url, api_key="x", max_retries=0)
        response = client.chat.completions.create(
            model=source.name, messages=chat("Hi"), max_tokens=4, temperature=0
        )
        assert response.choices[0].model_extra["rollout"]["policy_version"] == 3
    finally:
        server.stop()
        thread.join(WAIT_S)
    with pytest.raises(RolloutError, match="not a checkpoint or a run directory"):
        resolve_source(config=None, model=None, checkpoint=str(tmp_path), name=None)


@pytest.mark.slow
def test_a_trained_run_is_served_by_its_run_id_over_https(workdir):
    """`rollout run` trains two steps; `rollout serve --checkpoint <run-id>` finds the run in the
    store and serves its last checkpoint, whose step is the completions' policy version."""
    trained = rollout(
        workdir, "run", "--config", "examples/grpo-tiny.toml", "--set", "algorithm.max_steps=2",
        "--set", "checkpoint.interval=2", "--set", "data.eval.limit=8",
    )  # fmt: skip
    assert trained.returncode == 0, trained.stdout + trained.stderr
    store, record = only_run(workdir)
    assert [c.step for c in store.checkpoints(record.run_id)] == [2]
    cert, key = self_signed_certificate(workdir)
    process = subprocess.Popen(
        [sys.executable, "-m", "rollout", "serve", "--checkpoint", record.run_id, "--port", "0",
         "--tls-cert", str(cert), "--tls-key", str(key)],
        cwd=workdir, env=environment(workdir), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    try:
        line = ""
        while "serving" not in line:
            line = process.stdout.readline()
            assert line, "the server exited before serving"
        url = line.split(" at ")[1].split()[0]
        assert url.startswith("https://127.0.0.1:")
        client = trusting(cert, url)
        (model,) = client.models.list().data
        assert model.id.endswith("/step-000002")
        response = client.chat.completions.create(
            model=model.id, messages=chat("Hi"), max_tokens=4, temperature=0
        )
        assert response.choices[0].model_extra["rollout"]["policy_version"] == 2
        process.send_signal(signal.SIGTERM)
        assert process.wait(WAIT_S) == 0
    finally:
        if process.poll() is None:
            process.kill()


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_goes_away_has_its_request_cancelled(server, stream):
    assert tokens_sampled_for_a_client_that_leaves(server, stream=stream) < 1000


def tokens_sampled_for_a_client_that_leaves(
    server, *, stream: bool, tls: ssl.SSLContext | None = None
) -> int:
    """Ask for 1000 tokens, go away once they are being sampled, and count the tokens the
    engine samples until it settles: well short of 1000 when the request was cancelled."""
    import socket
    import time

    stats = server.model.service.stats
    before = stats.generated_tokens
    body = json.dumps(
        {"model": MODEL, "prompt": "Go on", "max_tokens": 1000, "temperature": 0, "stream": stream}
    ).encode()
    host, port = server.server_address[:2]
    connection = socket.create_connection((host, port), timeout=WAIT_S)
    if tls is not None:
        connection = tls.wrap_socket(connection, server_hostname=host)
    with connection:
        connection.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        while stats.generated_tokens == before:  # it is being sampled
            time.sleep(0.01)
    deadline = time.monotonic() + WAIT_S
    last = -1
    while stats.generated_tokens != last and time.monotonic() < deadline:
        last = stats.generated_tokens
        time.sleep(0.5)
    return stats.generated_tokens - before
