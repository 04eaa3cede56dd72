"""plan.lock: deterministic bytes, refusal of edited or foreign files, and staleness."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import rollout
from rollout.config import read_config_file, validate_config
from rollout.errors import LockfileError
from rollout.fingerprints import sha256_bytes, sha256_file
from rollout.harness.rewards import BUILTIN_REWARDS
from rollout.models.facts import ModelFacts
from rollout.planner.definition import (
    FORMAT_VERSION,
    DataFacts,
    Derived,
    Edge,
    FunctionRewardRecord,
    Graph,
    HardwareFacts,
    MemoryEstimate,
    Plan,
    ProcessSpec,
    RoleSpec,
    Seeds,
    Versions,
)
from rollout.planner.lockfile import canonical_json, read_plan, stale_reasons, write_plan
from rollout.plugins import installed_version, resolve_plugin

PLUGIN = """
def score(prompts, completions, **kwargs):
    return [1.0 for _ in completions]
"""


def build_plan(base: Path, reward: str = "numeric_match", **reward_settings: object) -> Plan:
    """A minimal but valid Plan made by hand, fresh against this environment and ``base``."""
    data = base / "train.jsonl"
    data.write_text('{"prompt": "1+1?", "answer": "2"}\n{"prompt": "2+3?", "answer": "5"}\n')
    config_file = base / "run.toml"
    config_file.write_text(
        textwrap.dedent(
            f"""
            [model]
            builtin = "tiny-llama"
            [data.train]
            path = "train.jsonl"
            [data.fields]
            answer = "answer"
            [algorithm]
            kind = "grpo"
            [[rewards]]
            fn = "{reward}"
            """
        )
    )
    raw = read_config_file(config_file)
    raw["rewards"][0].update(reward_settings)
    config = validate_config(raw, source=str(config_file))
    identity = resolve_plugin(
        reward, base_dir=base, used_by="rewards[0].fn", builtins=BUILTIN_REWARDS
    ).identity
    spec = config.rewards[0]
    record = FunctionRewardRecord(
        name=spec.metric_name,
        weight=spec.weight,
        options=spec.options,
        timeout_s=spec.timeout_s,
        plugin=identity,
    )
    return Plan(
        run_id="run-20250101-000000-abcd",
        created_at="2025-01-01T00:00:00+00:00",
        config_path=str(config_file),
        config_sha256=sha256_file(config_file),
        base_dir=str(base),
        config=config,
        derived=Derived(
            dtype="float32",
            precision="none",
            run_dir=str(base / "runs" / "run-20250101-000000-abcd"),
            store=str(base / "runs" / "rollout.db"),
            artifacts=str(base / "runs" / "artifacts"),
            threads_per_process=2,
            prompts_per_step=2,
            prompts_per_rank=2,
            minibatch_size=8,
            minibatch_per_rank=8,
            micro_batch_size=8,
            grad_accumulation=1,
            optimizer_steps_per_step=1,
            total_steps=100,
            total_optimizer_steps=100,
            max_sequence_length=768,
            kl_in_reward=False,
            keeps_reference_model=False,
            logprob_temperature=1.0,
            evaluates=False,
        ),
        rewards=[record],
        model=ModelFacts(
            source="builtin",
            location="builtin:tiny-llama",
            format="builtin",
            fingerprint=sha256_bytes(b"tiny-llama"),
            architecture="LlamaForCausalLM",
            model_type="llama",
            num_parameters=123_456,
            vocab_size=256,
            context_length=1024,
            hidden_size=64,
            num_layers=2,
            num_attention_heads=4,
            num_kv_heads=2,
            head_dim=16,
            intermediate_size=128,
            tie_word_embeddings=True,
            chat_template=True,
        ),
        data=[
            DataFacts(
                split="train",
                location=str(data),
                format="jsonl",
                num_records=2,
                fields=["answer", "prompt"],
                size_bytes=data.stat().st_size,
                fingerprint=sha256_file(data),
            )
        ],
        hardware=HardwareFacts(
            platform="linux", cpu_count=2, memory_bytes=8 << 30, memory_available_bytes=6 << 30
        ),
        graph=Graph(
            world_size=1,
            nnodes=1,
            nproc_per_node=1,
            device="cpu",
            backend="gloo",
            roles=[RoleSpec(role="actor", ranks=[0], what="generates completions")],
            processes=[
                ProcessSpec(rank=0, node=0, local_rank=0, device="cpu", roles=["actor", "learner"])
            ],
            edges=[
                Edge(source="actor", target="learner", kind="rollout_queue", transport="in_process")
            ],
        ),
        memory=[
            MemoryEstimate(
                device="cpu",
                capacity_bytes=8 << 30,
                items={"weights": 1000, "optimizer": 2000},
                total_bytes=3000,
                fits=True,
            )
        ],
        versions=Versions(
            python=platform.python_version(),
            rollout=installed_version("rollout") or "0",
            pydantic=installed_version("pydantic"),
            torch=installed_version("torch"),
            transformers=installed_version("transformers"),
            vllm=installed_version("vllm"),
        ),
        seeds=Seeds(root=0, data=1, sampling=2, per_rank=[3]),
    )


@pytest.fixture
def plan(tmp_path) -> Plan:
    return build_plan(tmp_path)


@pytest.fixture
def lock(tmp_path, plan) -> Path:
    path = tmp_path / "plan.lock"
    write_plan(plan, path)
    return path


def refusal(path: Path, **kwargs) -> LockfileError:
    with pytest.raises(LockfileError) as caught:
        read_plan(path, **kwargs)
    assert caught.value.source == str(path)
    return caught.value


def forge(path: Path, content: dict, *, format_version: int = FORMAT_VERSION) -> None:
    """Write ``content`` in the documented layout with a correct hash, as rollout plan would."""
    body = {"format": "rollout.plan", "format_version": format_version, "plan": content}
    document = {**body, "sha256": sha256_bytes(canonical_json(body).encode())}
    path.write_text(json.dumps(document, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


# ---------------------------------------------------------------------------------------------
# writing


def test_canonical_json_is_sorted_compact_and_unescaped():
    assert canonical_json({"b": [1, 2.5], "a": "é"}) == '{"a":"é","b":[1,2.5]}'
    with pytest.raises(ValueError):
        canonical_json({"x": float("nan")})


def test_round_trip_gives_an_equal_plan(plan, lock):
    assert read_plan(lock) == plan
    assert rollout.read_plan(lock) == plan


def test_equal_plans_give_identical_bytes(tmp_path, plan, lock):
    again = tmp_path / "elsewhere" / "nested" / "plan.lock"  # parents are created
    write_plan(read_plan(lock), again)
    assert again.read_bytes() == lock.read_bytes()


def test_layout_and_hash(plan, lock):
    text = lock.read_text(encoding="utf-8")
    assert text.endswith("}\n")
    assert text.startswith(
        f'{{\n  "format": "rollout.plan",\n  "format_version": {FORMAT_VERSION},\n'
    )
    document = json.loads(text)
    assert sorted(document) == ["format", "format_version", "plan", "sha256"]
    body = {key: document[key] for key in ("format", "format_version", "plan")}
    assert document["sha256"] == sha256_bytes(canonical_json(body).encode())
    assert document["plan"] == plan.model_dump(mode="json")


def test_write_leaves_no_temporary_files(tmp_path, plan, lock):
    write_plan(plan, lock)  # over an existing file
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")) == []


def test_non_finite_number_is_refused_with_its_path(tmp_path):
    # Validation refuses inf in a config; this guards everything else that reaches the file.
    plan = build_plan(tmp_path)
    reward = plan.config.rewards[0].model_copy(update={"weight": float("inf")})
    config = plan.config.model_copy(update={"rewards": [reward]})
    plan = plan.model_copy(update={"config": config})
    with pytest.raises(LockfileError) as caught:
        write_plan(plan, tmp_path / "plan.lock")
    (issue,) = caught.value.issues
    assert issue.path == "config.rewards[0].weight"
    assert not (tmp_path / "plan.lock").exists()


# ---------------------------------------------------------------------------------------------
# refusing files that are not this plan as written


def test_missing_file(tmp_path):
    error = refusal(tmp_path / "plan.lock")
    (issue,) = error.issues
    assert issue.path == "plan.lock"
    assert "no plan file" in issue.message
    assert "rollout plan --config CONFIG -o" in issue.hint


def test_not_json(tmp_path):
    path = tmp_path / "plan.lock"
    path.write_text('{\n  "format": "rollout.plan",\n  oops\n}\n')
    (issue,) = refusal(path).issues
    assert "not valid JSON" in issue.message and "line 3, column 3" in issue.message


def test_not_a_plan(tmp_path):
    path = tmp_path / "plan.lock"
    path.write_text('{"name": "something else"}\n')
    (issue,) = refusal(path).issues
    assert "is not a rollout plan" in issue.message


def test_edited_value_is_refused(plan, lock):
    lock.write_text(lock.read_text().replace(plan.run_id, plan.run_id[:-1] + "X"))
    (issue,) = refusal(lock).issues
    assert issue.path == "plan.lock"
    assert "edited after planning" in issue.message and "sha256" in issue.message
    assert f"rollout plan --config {plan.config_path} -o {lock}" in issue.hint


def test_one_flipped_byte_is_refused(lock):
    data = bytearray(lock.read_bytes())
    at = data.index(b'"num_records": 2') + len(b'"num_records": ')
    data[at] = ord("3")
    lock.write_bytes(bytes(data))
    assert "edited after planning" in str(refusal(lock))


@pytest.mark.parametrize(
    "edit",
    [
        lambda text: text.replace('\n  "format"', '\n    "format"', 1),  # indentation
        lambda text: text + "\n",  # a blank line at the end
        lambda text: text.replace(": ", ":  ", 1),
    ],
)
def test_whitespace_only_edit_is_refused(lock, edit):
    lock.write_text(edit(lock.read_text()))
    (issue,) = refusal(lock).issues
    assert "edited after planning" in issue.message
    assert "whitespace" in issue.message


def test_reordered_or_added_keys_are_refused(lock):
    document = json.loads(lock.read_text())
    reordered = dict(reversed(document.items()))
    lock.write_text(json.dumps(reordered, indent=2, ensure_ascii=False) + "\n")
    assert "bytes differ" in str(refusal(lock))
    document["comment"] = "checked by hand"
    lock.write_text(json.dumps(document, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
    assert "bytes differ" in str(refusal(lock))


def test_newer_format_version_asks_for_an_upgrade(plan, lock):
    content = plan.model_dump(mode="json")
    content["versions"]["rollout"] = "9.0.0"
    forge(lock, content, format_version=FORMAT_VERSION + 1)
    (issue,) = refusal(lock).issues
    assert f"plan format {FORMAT_VERSION + 1} by rollout 9.0.0" in issue.message
    assert "install rollout>=9.0.0" in issue.hint


def test_older_format_version_asks_to_plan_again(plan, lock):
    forge(lock, plan.model_dump(mode="json"), format_version=FORMAT_VERSION - 1)
    (issue,) = refusal(lock).issues
    assert "older" in issue.message
    assert issue.hint == f"re-run `rollout plan --config {plan.config_path} -o {lock}`"


def test_a_lock_of_the_previous_format_asks_to_plan_again(plan, lock):
    """Format 1 kept `plugins` (identities only); format 2 keeps one record per reward."""
    content = plan.model_dump(mode="json")
    content["plugins"] = [reward.pop("plugin") for reward in content.pop("rewards")]
    forge(lock, content, format_version=1)
    (issue,) = refusal(lock).issues
    assert "uses plan format 1, older than this rollout" in issue.message
    assert f"reads plan format {FORMAT_VERSION}" in issue.message
    assert issue.hint == f"re-run `rollout plan --config {plan.config_path} -o {lock}`"


def test_a_reward_without_its_record_is_refused(plan, lock):
    content = plan.model_dump(mode="json")
    content["rewards"] = []
    forge(lock, content)
    (issue,) = refusal(lock).issues
    assert "does not hold a valid plan" in issue.message
    assert "rewards must hold one record per config.rewards entry" in issue.message


def test_invalid_plan_content_is_refused_even_with_a_good_hash(plan, lock):
    content = plan.model_dump(mode="json")
    del content["seeds"]
    content["graph"]["world_size"] = "two"
    forge(lock, content)
    (issue,) = refusal(lock).issues
    assert "does not hold a valid plan" in issue.message
    assert "(and 1 more)" in issue.message


# ---------------------------------------------------------------------------------------------
# staleness


def test_edited_plugin_file_makes_the_plan_stale(tmp_path):
    plugin = tmp_path / "rewards.py"
    plugin.write_text(PLUGIN)
    lock = tmp_path / "plan.lock"
    write_plan(build_plan(tmp_path, reward="./rewards.py:score"), lock)
    assert read_plan(lock).plugins[0].kind == "file"
    plugin.write_text(PLUGIN + "# tuned\n")
    (issue,) = refusal(lock).issues
    assert issue.path == "rewards[0].fn"
    assert f"{plugin.resolve()} changed since planning (sha256 " in issue.message
    assert "rollout plan --config" in issue.hint


def test_edited_data_file_makes_the_plan_stale(tmp_path, lock):
    data = tmp_path / "train.jsonl"
    with data.open("a") as handle:
        handle.write('{"prompt": "3+4?", "answer": "7"}\n')
    (issue,) = refusal(lock).issues
    assert issue.path == "data.train.path"
    assert f"data file {data} changed since planning" in issue.message


def test_deleted_data_file_makes_the_plan_stale(tmp_path, lock):
    (tmp_path / "train.jsonl").unlink()
    (issue,) = refusal(lock).issues
    assert "no longer exists" in issue.message


def test_remote_data_is_not_reread(tmp_path):
    plan = build_plan(tmp_path)
    remote = plan.data[0].model_copy(update={"location": "s3://bucket/train.jsonl"})
    assert stale_reasons(plan.model_copy(update={"data": [remote]})) == []


def test_new_package_version_makes_the_plan_stale(lock):
    def upgraded(name: str) -> str | None:
        return "2.14.1" if name == "torch" else installed_version(name)

    (issue,) = refusal(lock, version_of=upgraded).issues
    assert issue.path == "versions.torch"
    planned = installed_version("torch") or "not installed"
    assert issue.message == f"torch {planned} → 2.14.1"


def test_edited_config_makes_the_plan_stale(plan, lock):
    config = Path(plan.config_path)
    config.write_text(config.read_text() + "\n[run]\nseed = 7\n")
    (issue,) = refusal(lock).issues
    assert issue.path == plan.config_path
    assert "the config changed since planning" in issue.message


def test_missing_config_is_not_a_change(plan, lock):
    Path(plan.config_path).unlink()
    assert read_plan(lock) == plan


def test_every_stale_reason_is_reported_at_once(tmp_path):
    plugin = tmp_path / "rewards.py"
    plugin.write_text(PLUGIN)
    plan = build_plan(tmp_path, reward="./rewards.py:score")
    lock = tmp_path / "out" / "plan.lock"
    write_plan(plan, lock)
    plugin.write_text(PLUGIN + "# tuned\n")
    (tmp_path / "train.jsonl").write_text('{"prompt": "p", "answer": "a"}\n')
    (tmp_path / "run.toml").write_text("# edited\n")

    def moved_on(name: str) -> str | None:
        return {"rollout": "0.2.0", "vllm": "0.11.0"}.get(name, installed_version(name))

    error = refusal(lock, version_of=moved_on)
    paths = [issue.path for issue in error.issues]
    assert paths == [
        "rewards[0].fn",
        "versions.rollout",
        "versions.vllm",
        "data.train.path",
        plan.config_path,
    ]
    rollout_now = installed_version("rollout")
    assert error.issues[1].message == f"rollout {rollout_now} → 0.2.0"
    assert all(issue.hint.startswith("re-run `rollout plan") for issue in error.issues)
    assert read_plan(lock, check_fresh=False) == plan


def test_reading_a_plan_imports_neither_torch_nor_plugins(tmp_path):
    marker = tmp_path / "imported"
    plugin = tmp_path / "rewards.py"
    plugin.write_text(f"open({str(marker)!r}, 'w').close()\n" + PLUGIN)
    lock = tmp_path / "plan.lock"
    write_plan(build_plan(tmp_path, reward="./rewards.py:score"), lock)
    marker.unlink()  # planning imported the plugin; reading the plan must not
    script = (
        "import sys; from rollout import read_plan; "
        f"read_plan({str(lock)!r}); "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert not marker.exists()
