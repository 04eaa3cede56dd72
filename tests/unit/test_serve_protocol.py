"""The request checks of `rollout serve` (rollout/serve/protocol.py), without a model: every
number out of the engine's range is a 400 naming its parameter, and everything that costs time or
memory in proportion to the request (prompts, messages, characters, stop strings) is refused
before that cost is paid. Over classes of values, not single examples."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout.serve.protocol import (
    MAX_MESSAGES,
    MAX_PROMPTS,
    MAX_STOP_CHARS,
    MAX_TOKEN_CHARS,
    MIN_TEMPERATURE,
    SEED_RANGE,
    ApiError,
    ModelInfo,
    parse_request,
    per_prompt,
)

CONTEXT = 64
VOCAB = 100


class Encoder:
    """One token a character; counts the characters it was asked to tokenize."""

    def __init__(self) -> None:
        self.chars = 0

    def __call__(self, text: str) -> list[int]:
        self.chars += len(text)
        return [ord(c) % VOCAB for c in text]

    def chat(self, messages: list[dict]) -> list[int]:
        return [1, *self(" ".join(m["content"] for m in messages))]


@pytest.fixture
def encoder() -> Encoder:
    return Encoder()


def served(encoder: Encoder) -> ModelInfo:
    return ModelInfo("m", CONTEXT, VOCAB, encoder, encoder.chat)


def refused(body: dict, kind: str = "completion", encoder: Encoder | None = None) -> ApiError:
    with pytest.raises(ApiError) as caught:
        parse_request(kind, body, served(encoder or Encoder()))  # type: ignore[arg-type]
    error = caught.value
    assert 400 <= error.status < 500
    assert set(error.body()["error"]) == {"message", "type", "param", "code"}
    return error


def completion(**fields) -> dict:
    return {"model": "m", "prompt": "hi", **fields}


def chat(**fields) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


# --- numbers out of range -------------------------------------------------------------------------

BEYOND_64_BITS = [2**63, 2**64, 2**64 + 5, -(2**63) - 1, 10**30, -(10**30), 10**400]
NOT_INTEGERS = [1.0, 2.5, -0.0, 1e308, float("inf"), float("-inf"), float("nan"), "1", True, [1]]
# param -> (kind, values that must be refused)
INTEGER_FIELDS = {
    "seed": ("completion", BEYOND_64_BITS),
    "n": ("completion", [0, -1, 17, *BEYOND_64_BITS]),
    "max_tokens": ("completion", [0, -1, CONTEXT + 1, *BEYOND_64_BITS]),
    "max_completion_tokens": ("chat", [0, -5, CONTEXT + 1, *BEYOND_64_BITS]),
    "top_k": ("completion", [-1, 2**31, *BEYOND_64_BITS]),
    "logprobs": ("completion", [-1, 6, *BEYOND_64_BITS]),
    "top_logprobs": ("chat", [-1, 21, *BEYOND_64_BITS]),
}
NUMBER_FIELDS = {
    "temperature": [-0.01, 2.01, 1e308, -1e308, 10**30, 2**64],
    "top_p": [0, 0.0, -0.5, 1.01, 1e308, 10**400],
}
NON_FINITE = [float("inf"), float("-inf"), float("nan"), "0.5", True, [0.5], {"x": 1}]

INTEGER_CASES = [
    (param, kind, value)
    for param, (kind, bad) in INTEGER_FIELDS.items()
    for value in [*bad, *NOT_INTEGERS]
]
NUMBER_CASES = [
    (param, value) for param, bad in NUMBER_FIELDS.items() for value in [*bad, *NON_FINITE]
]


@pytest.mark.parametrize(("param", "kind", "value"), INTEGER_CASES)
def test_an_integer_out_of_range_or_of_another_type_is_a_400_naming_it(param, kind, value):
    body = (chat if kind == "chat" else completion)(**{param: value})
    if param == "top_logprobs":
        body["logprobs"] = True
    assert refused(body, kind).param == param


@pytest.mark.parametrize(("param", "value"), NUMBER_CASES)
def test_a_number_out_of_range_or_not_finite_is_a_400_naming_it(param, value):
    assert refused(completion(**{param: value})).param == param


@pytest.mark.parametrize("value", [5e-324, 1e-300, 1e-40, 1e-6])
def test_a_temperature_near_0_samples_at_the_lowest_one_the_engine_can_divide_by(value):
    request = parse_request("completion", completion(temperature=value), served(Encoder()))
    assert request.params.temperature == MIN_TEMPERATURE
    greedy = parse_request("completion", completion(temperature=0), served(Encoder()))
    assert greedy.params.temperature == 0


@given(seed=st.integers(min_value=SEED_RANGE[0], max_value=SEED_RANGE[1]))
def test_every_64_bit_seed_is_taken_and_every_prompts_seed_fits_torch(seed):
    prompts = [[1, 2]] * MAX_PROMPTS
    request = parse_request("completion", completion(prompt=prompts, seed=seed), served(Encoder()))
    for index in range(len(prompts)):
        assert -(2**63) <= per_prompt(request, index).seed < 2**64  # what manual_seed takes


@given(value=st.integers(min_value=SEED_RANGE[1] + 1) | st.integers(max_value=SEED_RANGE[0] - 1))
def test_every_seed_beyond_64_bits_is_refused(value):
    assert refused(completion(seed=value)).param == "seed"


def json_round_trip(value):
    """What the server sees of a value after JSON (NaN and Infinity as Python writes them)."""
    return json.loads(json.dumps(value))


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=6,
)
FIELDS = [
    "n", "max_tokens", "temperature", "top_p", "top_k", "stop", "stream", "stream_options",
    "logprobs", "seed", "prompt", "model",
]  # fmt: skip


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(fields=st.dictionaries(st.sampled_from(FIELDS), JSON_VALUES, min_size=1, max_size=4))
def test_any_json_in_any_field_is_taken_or_refused_with_a_400(fields):
    body = completion(**{k: json_round_trip(v) for k, v in fields.items()})
    try:
        request = parse_request("completion", body, served(Encoder()))
    except ApiError as error:
        assert 400 <= error.status < 500 and error.message
        return
    params = request.params
    assert 1 <= params.n <= 16 and 1 <= params.max_new_tokens <= CONTEXT
    assert 0 <= params.temperature <= 2 and 0 < params.top_p <= 1 and 0 <= params.top_k < 2**31
    assert params.seed is None or SEED_RANGE[0] <= params.seed <= SEED_RANGE[1]


# --- sizes refused before their cost --------------------------------------------------------------

LIMIT_CHARS = CONTEXT * MAX_TOKEN_CHARS


@pytest.mark.parametrize("chars", [LIMIT_CHARS + 1, 2 * LIMIT_CHARS, 8 << 20])
@pytest.mark.parametrize("shape", ["string", "list", "chat", "chat-parts"])
def test_a_text_too_long_for_the_context_is_refused_untokenized(encoder, chars, shape):
    text = "x" * chars
    if shape == "string":
        body, kind = completion(prompt=text), "completion"
    elif shape == "list":
        body, kind = completion(prompt=["short", text]), "completion"
    elif shape == "chat":
        body, kind = chat(messages=[{"role": "user", "content": text}]), "chat"
    else:
        half = {"type": "text", "text": text[: chars // 2]}
        rest = {"type": "text", "text": text[chars // 2 :]}
        body, kind = chat(messages=[{"role": "user", "content": [half, rest]}]), "chat"
    error = refused(body, kind, encoder)
    assert error.code == "context_length_exceeded"
    assert error.param == ("messages" if kind == "chat" else "prompt")
    assert encoder.chars == 0  # nothing was tokenized


@pytest.mark.parametrize("count", [MAX_PROMPTS + 1, 1000, 100_000])
@pytest.mark.parametrize("shape", ["strings", "token-lists"])
def test_too_many_prompts_are_refused_before_any_is_tokenized(encoder, count, shape):
    prompts = ["hi"] * count if shape == "strings" else [[1, 2]] * count
    error = refused(completion(prompt=prompts), encoder=encoder)
    assert error.param == "prompt" and str(MAX_PROMPTS) in error.message
    assert encoder.chars == 0


@pytest.mark.parametrize("count", [MAX_MESSAGES + 1, 100_000])
def test_too_many_messages_are_refused_before_the_template_runs(encoder, count):
    messages = [{"role": "user", "content": "x"}] * count
    error = refused(chat(messages=messages), "chat", encoder)
    assert error.param == "messages" and encoder.chars == 0


@pytest.mark.parametrize(
    "stop",
    ["", "x" * (MAX_STOP_CHARS + 1), ["a", "x" * 10_000], ["a"] * 5, [1], [None], {"a": 1}],
)
def test_stop_strings_are_bounded_in_number_and_length(stop):
    assert refused(completion(stop=stop)).param == "stop"


@pytest.mark.parametrize(
    ("prompt", "max_tokens"),
    [
        ("x" * CONTEXT, None),
        ("x" * (CONTEXT - 1), 2),
        ([[1] * (CONTEXT + 5)], None),
        ("x" * 40, 30),
    ],
)
def test_a_prompt_that_leaves_no_room_is_context_length_exceeded(prompt, max_tokens):
    body = completion(prompt=prompt) | ({"max_tokens": max_tokens} if max_tokens else {})
    error = refused(body)
    assert error.code == "context_length_exceeded" and error.param == "prompt"


def test_the_default_max_tokens_is_cut_to_the_room_the_prompt_leaves():
    request = parse_request("completion", completion(prompt="x" * 60), served(Encoder()))
    assert request.params.max_new_tokens == CONTEXT - 60


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
        ({"stream_options": []}, "stream_options"),
        ({"model": 7}, "model"),
        ({"model": "x" * 10_000}, "model"),
    ],
)
def test_other_fields_of_the_wrong_type_name_themselves(body, param):
    error = refused(completion(**body))
    assert error.param == param and len(error.message) < 300  # an echo stays short


@pytest.mark.parametrize(
    "model", ["https://user:CANARY@host/m", "s3://key:" + "CANARY" * 30 + "@bucket/m"]
)
def test_error_messages_never_echo_a_credential(model):
    error = refused(completion(model=model))
    assert "CANARY" not in json.dumps(error.body())


@pytest.mark.parametrize("role", [["user"], {"a": 1}, 3, None, "robot"])
def test_a_role_that_is_not_a_known_string_is_a_400_naming_it(encoder, role):
    # An unhashable role (a list, an object) once raised TypeError: a 500 instead of a 400.
    error = refused(chat(messages=[{"role": role, "content": "hi"}]), "chat", encoder)
    assert error.param == "messages[0].role"
