"""Engine plugins below the CLI: the config accepts a reference and catches typos, the rules treat
a plugin as the hf engine it most likely wraps, build_engine calls the factory with an EngineSpec
and refuses what is no engine, and a served plugin answers through a BatchService (swapped by a
ReloadableService under `serve --dev`)."""

from __future__ import annotations

import dataclasses

import pytest

from rollout.config import validate_config
from rollout.engines.base import SamplingParams, default_batch_size
from rollout.engines.batch_service import BatchService
from rollout.engines.build import build_engine
from rollout.engines.hf.engine import HfEngine
from rollout.engines.plugin import EnginePlugin, EngineSpec, factory_problems, missing_members
from rollout.errors import ConfigError, PlanError
from rollout.serve.reloading import ReloadableService


def issues_of(config: dict) -> dict[str, object]:
    try:
        validate_config(config)
    except ConfigError as error:
        return {issue.path: issue for issue in error.issues}
    return {}


@pytest.mark.parametrize("ref", ["./engine.py:make", "my_pkg.engines:make", "fast_engine"])
def test_the_config_takes_an_engine_plugin_reference(base_config, ref):
    assert issues_of({**base_config, "generation": {"engine": ref}}) == {}


@pytest.mark.parametrize(("typo", "meant"), [("hff", "hf"), ("HF", "hf"), ("vlm", "vllm")])
def test_a_name_close_to_a_built_in_engine_is_a_typo(base_config, typo, meant):
    issue = issues_of({**base_config, "generation": {"engine": typo}})["generation.engine"]
    assert issue.hint == f"did you mean {meant!r}?"


def test_vllm_only_keys_are_refused_with_a_plugin_engine(base_config):
    config = {**base_config, "generation": {"engine": "./e.py:make", "gpu_memory_utilization": 0.7}}
    issue = issues_of(config)["generation.gpu_memory_utilization"]
    assert "the ./e.py:make engine would ignore it" in issue.message


def test_an_offline_run_refuses_a_plugin_engine(base_config):
    config = {
        **base_config,
        "algorithm": {"kind": "sft"},
        "rewards": [],
        "generation": {"engine": "./e.py:make"},
    }
    assert "generation" in " ".join(issues_of(config))


def test_a_plugin_engine_gets_the_hf_engines_batch_size():
    assert default_batch_size("./e.py:make") == default_batch_size("hf") == 32
    assert default_batch_size("vllm") == 256


class Marking:
    """An engine plugin as docs/plugins.md writes one: the hf engine, its texts marked."""

    def __init__(self, inner, mark="[m]"):
        self.inner, self.mark = inner, mark

    def generate(self, prompts, params):
        out = self.inner.generate(prompts, params)
        return [dataclasses.replace(c, text=self.mark + c.text) for c in out]

    def load_weights(self, weights, version):
        self.inner.load_weights(weights, version)

    @property
    def policy_version(self):
        return self.inner.policy_version

    @property
    def stats(self):
        return self.inner.stats

    def close(self):
        self.inner.close()


def tokens(tiny_llama):
    return dict(
        tokenizer=tiny_llama.tokenizer,
        eos_token_ids=tiny_llama.eos_token_ids,
        pad_token_id=tiny_llama.pad_token_id,
        device="cpu",
    )


def test_build_engine_calls_the_factory_with_its_arguments(tiny_llama):
    seen: list[EngineSpec] = []

    def make(spec):
        seen.append(spec)
        return Marking(spec.hf_engine())

    plugin = EnginePlugin("./e.py:make", "generation.engine", make)
    engine = build_engine(
        "./e.py:make", model=tiny_llama.model, **tokens(tiny_llama), max_batch_size=3, seed=7,
        max_context=64, plugin=plugin,
    )  # fmt: skip
    (spec,) = seen
    assert spec.model is tiny_llama.model and spec.max_batch_size == 3 and spec.seed == 7
    assert spec.max_context == 64 and spec.device == "cpu"
    assert isinstance(engine.inner, HfEngine) and engine.inner.model is tiny_llama.model
    (completion,) = engine.generate([[1, 20, 30]], SamplingParams(max_new_tokens=4, seed=0))
    assert completion.text.startswith("[m]") and len(completion.token_ids) <= 4


def test_a_factory_that_returns_no_engine_is_one_error_naming_it(tiny_llama):
    plugin = EnginePlugin("./e.py:make", "generation.engine", lambda spec: object())
    with pytest.raises(PlanError) as caught:
        build_engine("./e.py:make", model=tiny_llama.model, **tokens(tiny_llama),
                     max_batch_size=None, plugin=plugin)  # fmt: skip
    (issue,) = caught.value.issues
    assert issue.path == "generation.engine"
    assert "'./e.py:make' returned a object, which has no generate(), load_weights(), close()" in (
        issue.message
    )
    assert "policy_version, stats" in issue.message


class NoClose:
    def generate(self, prompts, params): ...

    def load_weights(self, weights, version): ...


def annotated(spec) -> NoClose:
    return NoClose()


def test_what_a_factory_builds_is_checked_without_calling_it():
    def two(spec, other):
        return Marking(None)

    assert factory_problems(lambda spec: None) == []  # nothing says what it builds
    assert factory_problems(Marking) == []  # a class whose instances are engines
    assert factory_problems(NoClose) == [
        "it cannot be called as make(spec): its signature is ()",
        "it builds a NoClose, which has no close()",
    ]
    assert factory_problems(annotated) == ["it builds a NoClose, which has no close()"]
    assert factory_problems(two)[0].startswith("it cannot be called as make(spec)")
    assert missing_members(Marking, instance=False) == []


def served_plugin(tiny_llama, mark="[m]"):
    return Marking(HfEngine(tiny_llama.model, **tokens(tiny_llama), max_batch_size=4), mark)


def test_a_batch_service_answers_concurrent_requests_with_whole_completions(tiny_llama):
    with BatchService(served_plugin(tiny_llama), tiny_llama.tokenizer) as service:
        params = SamplingParams(max_new_tokens=4, n=2, seed=1)
        handles = service.submit_many([[1, 20], [1, 30, 40]], [params, params])
        single = service.submit([1, 50], SamplingParams(max_new_tokens=3, seed=2))
        for handle in (*handles, single):
            completions = handle.result(timeout=60)
            assert all(c.text.startswith("[m]") for c in completions)
        assert [len(h.result()) for h in handles] == [2, 2]
        events = list(single.events(timeout=60))
        assert len(events) == 1 and events[0].completion is not None


def test_a_failing_call_fails_its_requests_not_the_service(tiny_llama):
    class Failing(Marking):
        def generate(self, prompts, params):
            if params.max_new_tokens == 1:
                raise RuntimeError("bad step")
            return super().generate(prompts, params)

    engine = Failing(HfEngine(tiny_llama.model, **tokens(tiny_llama), max_batch_size=4))
    with BatchService(engine, tiny_llama.tokenizer) as service:
        failing = service.submit([1, 20], SamplingParams(max_new_tokens=1))
        with pytest.raises(RuntimeError, match="bad step"):
            failing.result(timeout=60)
        fine = service.submit([1, 20], SamplingParams(max_new_tokens=2, seed=0))
        assert fine.result(timeout=60)[0].text.startswith("[m]")


def test_a_swap_finishes_what_is_in_flight_then_serves_with_the_new_engine(tiny_llama):
    old = BatchService(served_plugin(tiny_llama, "[old]"), tiny_llama.tokenizer)
    service = ReloadableService(old)
    before = service.submit([1, 20], SamplingParams(max_new_tokens=4, seed=0))
    service.swap(lambda: BatchService(served_plugin(tiny_llama, "[new]"), tiny_llama.tokenizer))
    assert before.result(timeout=60)[0].text.startswith("[old]")
    assert old.closing
    after = service.submit([1, 20], SamplingParams(max_new_tokens=4, seed=0))
    assert after.result(timeout=60)[0].text.startswith("[new]")
    service.close()


@pytest.mark.parametrize(
    ("engine", "expected"),
    [
        ("vllm", "vllm has a server of its own"),
        ("hff", "did you mean 'hf'?"),
        ("./absent_engine.py:make", "plugin file './absent_engine.py' not found"),
    ],
)
def test_serve_refuses_an_engine_it_cannot_serve_before_loading_a_model(engine, expected):
    from pathlib import Path

    from rollout.errors import RolloutError
    from rollout.inference.serve_source import EngineChoice, _engine_plugin

    with pytest.raises(RolloutError) as caught:
        _engine_plugin(EngineChoice(engine, "--engine", Path.cwd()))
    (issue,) = caught.value.issues
    assert issue.path == "--engine"
    assert expected in f"{issue.message} {issue.hint}"


def test_a_served_config_runs_its_own_engine_unless_the_flag_says_otherwise(tmp_path, base_config):
    """`rollout serve --config` serves the engine the config trains with (a file plugin relative
    to the config), --engine overrides it, and a config's vllm is refused naming its key."""
    from rollout.errors import RolloutError
    from rollout.inference.serve_source import _engine_plugin, choose_engine, resolve_source
    from tests.conftest import write_toml

    (tmp_path / "engine.py").write_text(
        "from rollout.engines.plugin import EngineSpec\n\n"
        "def make(spec: EngineSpec):\n    return spec.hf_engine()\n"
    )
    config = dict(
        base_config, generation={**base_config["generation"], "engine": "./engine.py:make"}
    )
    path = write_toml(tmp_path / "run.toml", config)
    source = resolve_source(config=path, model=None, checkpoint=None, name=None)
    chosen = choose_engine(None, source)
    assert (chosen.ref, chosen.where, chosen.base_dir) == (
        "./engine.py:make",
        "generation.engine",
        tmp_path,
    )
    assert _engine_plugin(chosen).identity.ref == "./engine.py:make"  # found beside the config
    assert choose_engine("hf", source).ref == "hf"
    config["generation"]["engine"] = "vllm"
    config["cluster"] = {"device": "cuda"}  # what a vllm config says (serve reads no hardware)
    source = resolve_source(
        config=write_toml(tmp_path / "run.toml", config), model=None, checkpoint=None, name=None
    )
    with pytest.raises(RolloutError) as caught:
        _engine_plugin(choose_engine(None, source))
    assert caught.value.issues[0].path == "generation.engine"


def test_the_hf_engine_is_served_continuously_batched_and_a_plugin_in_whole_calls(tiny_llama):
    from rollout.engines.service import EngineService
    from rollout.serve.loading import engine_service

    hf = HfEngine(tiny_llama.model, **tokens(tiny_llama), max_batch_size=4)
    plugin = served_plugin(tiny_llama)
    for engine, kind in ((hf, EngineService), (plugin, BatchService)):
        service = engine_service(engine, tiny_llama.tokenizer)
        assert isinstance(service, kind)
        service.close()
