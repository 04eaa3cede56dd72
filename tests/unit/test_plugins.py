"""Resolving plugin references, checking reward signatures, and noticing plugin changes.

Every plugin here is real: files written to tmp_path, packages imported from a tmp directory on
sys.path, and an installed distribution (a dist-info folder) that importlib.metadata finds.
"""

from __future__ import annotations

import importlib.metadata
import json
import sys
import textwrap
from pathlib import Path

import pytest

from rollout.errors import PlanError
from rollout.fingerprints import sha256_file
from rollout.harness.reward_contract import check_reward_signature
from rollout.harness.rewards import BUILTIN_REWARDS, numeric_match, regex_match
from rollout.plugins import ResolvedPlugin, plugin_changes, resolve_plugin

USED_BY = "rewards[0].fn"

GOOD = """
def score(prompts, completions, **kwargs):
    return [float(len(c)) for c in completions]
"""


@pytest.fixture(autouse=True)
def forget_tmp_modules(tmp_path):
    """Modules imported from this test's tmp_path must not leak into the next test."""
    yield
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if file and Path(file).resolve().is_relative_to(tmp_path.resolve()):
            del sys.modules[name]


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text).lstrip())
    return path


def resolve(ref: str, base_dir: Path) -> ResolvedPlugin:
    return resolve_plugin(ref, base_dir=base_dir, used_by=USED_BY, builtins=BUILTIN_REWARDS)


def refusal(ref: str, base_dir: Path) -> str:
    """Resolve ``ref`` expecting one clean issue at USED_BY; return the error text."""
    with pytest.raises(PlanError) as caught:
        resolve(ref, base_dir)
    (issue,) = caught.value.issues
    assert issue.path == USED_BY
    text = str(caught.value)
    assert "Traceback" not in text
    return text


def install(site: Path, name: str, module: str, *, editable: bool = False) -> None:
    """A real installed distribution NAME 1.0: its module, metadata and one rewards entry point."""
    write(site / f"{module}.py", GOOD)
    info = site / f"{name.replace('-', '_')}-1.0.dist-info"
    write(info / "METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    write(info / "top_level.txt", f"{module}\n")
    write(info / "entry_points.txt", f"[rollout.rewards]\n{module}_score = {module}:score\n")
    if editable:
        direct_url = {"url": f"file://{site}", "dir_info": {"editable": True}}
        write(info / "direct_url.json", json.dumps(direct_url))


@pytest.fixture
def installed_dist(tmp_path, monkeypatch):
    """'rp-dist' 1.0 providing module rp_ep and the entry point rp_ep_score."""
    site = tmp_path / "site"
    install(site, "rp-dist", "rp_ep")
    monkeypatch.syspath_prepend(str(site))
    return site


# ---------------------------------------------------------------------------------------------
# built-ins


def test_builtin_resolves_to_rollouts_own_function(tmp_path):
    resolved = resolve("numeric_match", tmp_path)
    assert resolved.fn is numeric_match
    identity = resolved.identity
    assert identity.kind == "builtin"
    assert identity.used_by == USED_BY and identity.ref == "numeric_match"
    assert (identity.module, identity.qualname) == ("rollout.harness.rewards", "numeric_match")
    assert identity.distribution == "rollout"
    assert identity.version == importlib.metadata.version("rollout")
    assert identity.sha256 is None
    assert Path(identity.path).name == "rewards.py"
    assert "answer" in identity.signature


def test_unknown_name_suggests_and_lists_what_exists(tmp_path):
    text = refusal("numeric_mach", tmp_path)
    assert "did you mean 'numeric_match'?" in text
    assert "exact_match, length_penalty, numeric_match, regex_match" in text
    assert "'rollout.rewards'" in text


# ---------------------------------------------------------------------------------------------
# file plugins


def test_file_plugin_resolves_relative_to_base_dir(tmp_path):
    path = write(tmp_path / "rewards.py", GOOD)
    resolved = resolve("./rewards.py:score", tmp_path)
    assert resolved.fn(["p", "p"], ["ab", "abc"]) == [2.0, 3.0]
    identity = resolved.identity
    assert identity.kind == "file"
    assert (identity.module, identity.qualname) == ("rewards", "score")
    assert identity.path == str(path.resolve())
    assert identity.sha256 == sha256_file(path)
    assert identity.distribution is None and identity.version is None
    assert identity.signature == "(prompts, completions, **kwargs)"
    assert "rewards" not in sys.modules  # loaded under a synthetic name only


def test_file_plugins_with_the_same_name_do_not_collide(tmp_path):
    write(tmp_path / "a" / "rewards.py", "def score(prompts, completions):\n    return [1.0]\n")
    write(tmp_path / "b" / "rewards.py", "def score(prompts, completions):\n    return [2.0]\n")
    first = resolve("a/rewards.py:score", tmp_path).fn
    second = resolve("b/rewards.py:score", tmp_path).fn
    assert (first([], []), second([], [])) == ([1.0], [2.0])
    assert first([], []) == [1.0]  # resolving b did not replace a


def test_file_plugin_attribute_path(tmp_path):
    write(
        tmp_path / "rewards.py",
        """
        class Scorer:
            @staticmethod
            def score(prompts, completions):
                return [0.5 for _ in completions]
        """,
    )
    resolved = resolve("rewards.py:Scorer.score", tmp_path)
    assert resolved.fn(["p"], ["c"]) == [0.5]
    assert resolved.identity.qualname == "Scorer.score"


def test_missing_file_suggests_a_nearby_one(tmp_path):
    write(tmp_path / "rewards.py", GOOD)
    text = refusal("./reward.py:score", tmp_path)
    assert "not found" in text and str(tmp_path / "reward.py") in text
    assert "did you mean './rewards.py'?" in text


def test_missing_file_lists_the_py_files_there(tmp_path):
    write(tmp_path / "scoring.py", GOOD)
    text = refusal("./zzz.py:score", tmp_path)
    assert "scoring.py" in text


def test_syntax_error_names_file_and_line(tmp_path):
    path = write(tmp_path / "rewards.py", "import math\n\ndef score(prompts, completions:\n")
    text = refusal("./rewards.py:score", tmp_path)
    assert "syntax error" in text
    assert f"{path.resolve()}:3" in text


def test_exception_at_import_names_type_message_and_own_line(tmp_path):
    path = write(
        tmp_path / "rewards.py",
        """
        import json

        SETTINGS = json.loads("{not json")
        """,
    )
    text = refusal("./rewards.py:score", tmp_path)
    assert "JSONDecodeError" in text
    # the plugin's own line, not the json library's frame where it was raised
    assert f"{path.resolve()}:3" in text
    assert "decoder.py" not in text
    # the half-run module is not left behind
    assert str(path.resolve()) not in {getattr(m, "__file__", None) for m in sys.modules.values()}


def test_missing_dependency_of_a_file_plugin_is_an_import_failure(tmp_path):
    write(tmp_path / "rewards.py", "import rp_no_such_dependency\n")
    text = refusal("./rewards.py:score", tmp_path)
    assert "ModuleNotFoundError" in text and "rp_no_such_dependency" in text
    assert "rewards.py:1" in text


def test_missing_attribute_suggests_a_public_callable(tmp_path):
    write(tmp_path / "rewards.py", GOOD + "\ndef _helper():\n    pass\n")
    text = refusal("./rewards.py:scor", tmp_path)
    assert "has no attribute 'scor'" in text
    assert "did you mean 'score'?" in text


def test_missing_attribute_lists_public_callables(tmp_path):
    write(tmp_path / "rewards.py", GOOD)
    text = refusal("./rewards.py:reward_fn", tmp_path)
    assert "it defines: score" in text


def test_not_callable(tmp_path):
    write(tmp_path / "rewards.py", "THRESHOLD = 3\n")
    text = refusal("./rewards.py:THRESHOLD", tmp_path)
    assert "is a int, not a function" in text


# ---------------------------------------------------------------------------------------------
# module plugins


@pytest.fixture
def package_dir(tmp_path, monkeypatch):
    root = tmp_path / "importable"
    write(root / "rp_pkg" / "__init__.py", "")
    write(root / "rp_pkg" / "scoring.py", GOOD)
    write(root / "rp_broken" / "__init__.py", "from rp_broken import inner\n")
    write(root / "rp_broken" / "inner.py", "VALUE = 1\n\nraise RuntimeError('no GPU here')\n")
    write(root / "rp_needs_dep" / "__init__.py", "import rp_no_such_dependency\n")
    monkeypatch.syspath_prepend(str(root))
    return root


def test_module_plugin_outside_any_distribution_is_fingerprinted(tmp_path, package_dir):
    resolved = resolve("rp_pkg.scoring:score", tmp_path)
    assert resolved.fn(["p"], ["abcd"]) == [4.0]
    identity = resolved.identity
    assert identity.kind == "module"
    assert (identity.module, identity.qualname) == ("rp_pkg.scoring", "score")
    source = package_dir / "rp_pkg" / "scoring.py"
    assert identity.path == str(source.resolve())
    assert identity.sha256 == sha256_file(source)
    assert identity.distribution is None


@pytest.mark.parametrize("ref", ["rp_absent_pkg.rewards:score", "rp_pkg.absent:score"])
def test_module_not_found(tmp_path, package_dir, ref):
    text = refusal(ref, tmp_path)
    assert f"module {ref.split(':')[0]!r} not found" in text
    assert "PYTHONPATH" in text


def test_module_raising_at_import_names_the_line_in_the_package(tmp_path, package_dir):
    text = refusal("rp_broken:score", tmp_path)
    assert "RuntimeError: no GPU here" in text
    assert f"{(package_dir / 'rp_broken' / 'inner.py').resolve()}:3" in text


def test_module_with_a_missing_dependency_is_not_reported_as_missing(tmp_path, package_dir):
    text = refusal("rp_needs_dep:score", tmp_path)
    assert "ModuleNotFoundError" in text and "rp_no_such_dependency" in text
    assert "module 'rp_needs_dep' not found" not in text


def test_module_attribute_missing(tmp_path, package_dir):
    text = refusal("rp_pkg.scoring:scores", tmp_path)
    assert "rp_pkg.scoring has no attribute 'scores'" in text
    assert "did you mean 'score'?" in text


def test_module_in_an_installed_distribution_records_its_version(tmp_path, installed_dist):
    identity = resolve("rp_ep:score", tmp_path).identity
    assert identity.kind == "module"
    assert (identity.distribution, identity.version) == ("rp-dist", "1.0")
    assert identity.sha256 is None


def test_module_in_an_editable_install_is_also_fingerprinted(tmp_path, monkeypatch):
    site = tmp_path / "site"
    install(site, "rp-editable", "rp_edit", editable=True)
    monkeypatch.syspath_prepend(str(site))
    identity = resolve("rp_edit:score", tmp_path).identity
    assert (identity.distribution, identity.version) == ("rp-editable", "1.0")
    assert identity.sha256 == sha256_file(site / "rp_edit.py")
    (site / "rp_edit.py").write_text(GOOD + "# edited in place, same version\n")
    (issue,) = plugin_changes(identity)
    assert "changed since planning" in issue.message


# ---------------------------------------------------------------------------------------------
# entry points


def test_entry_point_resolves_through_its_distribution(tmp_path, installed_dist):
    resolved = resolve("rp_ep_score", tmp_path)
    assert resolved.fn(["p"], ["xyz"]) == [3.0]
    identity = resolved.identity
    assert identity.kind == "entry_point"
    assert (identity.module, identity.qualname) == ("rp_ep", "score")
    assert (identity.distribution, identity.version) == ("rp-dist", "1.0")


def test_unknown_name_suggests_entry_points_too(tmp_path, installed_dist):
    text = refusal("rp_ep_scor", tmp_path)
    assert "did you mean 'rp_ep_score'?" in text
    assert "entry points: rp_ep_score" in text


# ---------------------------------------------------------------------------------------------
# reward signatures


def check(fn, options=None, fields=frozenset({"prompt", "answer"})):
    return check_reward_signature(fn, options=options or {}, fields=set(fields), used_by=USED_BY)


def test_builtin_with_its_field_present_is_fine():
    assert check(numeric_match, {"tolerance": 0.5}) == []


def test_misspelled_option_is_reported_at_its_path():
    (issue,) = check(numeric_match, {"tolerence": 0.5})
    assert issue.path == "rewards[0].options.tolerence"
    assert issue.hint == "did you mean 'tolerance'?"


def test_unknown_option_lists_the_accepted_ones():
    (issue,) = check(numeric_match, {"mode": "strict"})
    assert "answer, tolerance" in issue.hint


def test_required_field_missing_from_the_data():
    (issue,) = check(numeric_match, fields={"prompt", "question"})
    assert issue.path == USED_BY
    assert "'answer'" in issue.message
    assert "prompt, question" in issue.hint


def test_required_option_missing():
    (issue,) = check(regex_match)
    assert "'pattern'" in issue.message
    assert "rewards[0].options.pattern" in issue.hint
    assert check(regex_match, {"pattern": "x"}) == []


def test_var_keyword_accepts_any_option(tmp_path):
    write(tmp_path / "rewards.py", GOOD)
    assert check(resolve("rewards.py:score", tmp_path).fn, {"anything": 1}) == []


def test_wrong_signature_from_a_file(tmp_path):
    write(tmp_path / "rewards.py", "def score(completions):\n    return [0.0]\n")
    (issue,) = check(resolve("rewards.py:score", tmp_path).fn)
    assert issue.path == USED_BY
    assert "two positional arguments" in issue.message
    assert "(completions)" in issue.message


def test_options_mismatch_from_a_file(tmp_path):
    write(
        tmp_path / "rewards.py",
        """
        def score(prompts, completions, *, threshold, scale=1.0):
            return [scale * (len(c) > threshold) for c in completions]
        """,
    )
    fn = resolve("rewards.py:score", tmp_path).fn
    assert check(fn, {"threshold": 3}) == []
    unknown, unsatisfied = check(fn, {"treshold": 3})
    assert unknown.path == "rewards[0].options.treshold"
    assert unknown.hint == "did you mean 'threshold'?"
    assert "'threshold'" in unsatisfied.message


def test_positional_only_parameter_beyond_two_cannot_be_filled():
    def score(prompts, completions, extra, /):
        return []

    (issue,) = check(score)
    assert "two positional arguments" in issue.message


def test_star_args_take_prompts_and_completions():
    def score(*args, answer):
        return []

    assert check(score) == []


def test_an_option_the_function_cannot_take_names_its_signature_the_call_and_the_fix():
    def score(prompts, completions):
        return []

    (issue,) = check(score, {"scale": 2})
    assert issue.path == "rewards[0].options.scale"
    assert issue.message == (
        "score(prompts, completions) has no parameter 'scale', and the run passes the option as "
        "scale=2"
    )
    assert issue.hint == (
        "the parameters it accepts: none; add a parameter 'scale' or **kwargs to score, or remove "
        "the option"
    )


def test_a_parameter_given_twice_names_the_plugin_its_signature_the_call_and_the_fix(tmp_path):
    """Named prompt/completion, the first two parameters collide with the 'prompt' role that
    **kwargs receives: the run's call fails with "got multiple values for argument 'prompt'"."""
    write(
        tmp_path / "rewards.py",
        "def score(prompt, completion, **kwargs):\n    return [0.0] * len(completion)\n",
    )
    fn = resolve("rewards.py:score", tmp_path).fn
    (issue,) = check_reward_signature(
        fn,
        options={"scale": 2},
        fields={"prompt", "answer"},
        used_by=USED_BY,
        ref="./rewards.py:score",
    )
    assert (issue.path, issue.value) == (USED_BY, "./rewards.py:score")
    assert issue.message == (
        "score(prompt, completion, **kwargs) cannot take the call the run makes, "
        "score(prompts, completions, answer=[...], prompt=[...], scale=2): 'prompt' would get two "
        "values, the prompts by position and the field 'prompt' of the data by keyword"
    )
    assert issue.hint == (
        "make the first two parameters positional-only (score(prompt, completion, /, ...)) or "
        "name them prompts and completions"
    )


def test_an_option_named_like_the_first_two_parameters_is_given_twice():
    def score(prompts, completions):
        return []

    (issue,) = check(score, {"completions": 3})
    assert "'completions' would get two values, the completions by position and the option" in (
        issue.message
    )
    assert issue.hint.startswith("rename the option, or make the first two parameters")


def test_the_eval_data_is_checked_too():
    def needs_difficulty(prompts, completions, *, difficulty):
        return []

    def takes_everything(prompts, completions, **kwargs):
        return []

    fields = {"prompt", "answer", "difficulty"}
    (issue,) = check_reward_signature(
        needs_difficulty, options={}, fields=fields, eval_fields={"prompt"}, used_by=USED_BY
    )
    assert issue.message == (
        "needs_difficulty() requires 'difficulty', which is neither an option nor a field of the "
        "eval data"
    )
    assert "(the eval data has: prompt)" in issue.hint
    (issue,) = check_reward_signature(
        takes_everything, options={}, fields=fields, eval_fields={"completions"}, used_by=USED_BY
    )
    assert "the field 'completions' of the eval data by keyword" in issue.message


# The plan accepts a reward exactly when the run's own reward runner can call it: each signature,
# with these options, on records holding the fields 'prompt' and 'answer'.
CALLS = [
    ("prompts, completions", {}, True),  # gets no keyword at all: no field is named
    ("prompts, completions", {"scale": 2}, False),
    ("prompts, completions, **kwargs", {"scale": 2}, True),
    ("prompts, completions, *, answer", {}, True),
    ("prompts, completions, answer=None, prompt=None", {}, True),
    ("prompts, completions, *, rubric", {}, False),
    ("prompts, completions, *, rubric", {"rubric": "strict"}, True),
    ("prompts, completions, extra", {}, False),
    ("prompts, completions, extra, /", {}, False),
    ("completions", {}, False),
    ("prompt, completion, **kwargs", {}, False),
    ("prompt, completion, /, **kwargs", {}, True),
    ("prompt, completion, answer", {}, True),  # 'prompt' is not passed: it fills the first slot
    ("prompts, completions", {"completions": 1}, False),
    ("prompts, completions, **kwargs", {"prompts": 1}, False),
    ("prompts, *args, **kwargs", {"prompts": 1}, False),
    ("*args, answer", {}, True),
    ("*args, **kwargs", {"prompt": 1}, True),
]


@pytest.mark.parametrize(("parameters", "options", "works"), CALLS)
def test_the_plan_accepts_exactly_what_the_reward_runner_can_call(parameters, options, works):
    from rollout.harness.reward_contract import RewardError, describe
    from rollout.harness.reward_runner import RewardRunner

    namespace: dict = {}
    exec(f"def score({parameters}):\n    return [0.0]", namespace)
    fn = namespace["score"]
    runner = RewardRunner([describe("score", fn, 1.0, options, timeout_s=10)])
    try:
        runner.score(["p"], ["c"], [{"prompt": "p", "answer": "1"}])
        ran = True
    except RewardError as error:
        assert "TypeError" in str(error)
        ran = False
    assert ran is works
    issues = check(fn, options, fields={"prompt", "answer"})
    assert (issues == []) is works, issues


# ---------------------------------------------------------------------------------------------
# freshness


def test_unchanged_plugins_are_fresh(tmp_path, installed_dist):
    write(tmp_path / "rewards.py", GOOD)
    for ref in ("numeric_match", "rewards.py:score", "rp_ep_score"):
        assert plugin_changes(resolve(ref, tmp_path).identity) == []


def test_edited_file_is_reported_with_both_hashes(tmp_path):
    path = write(tmp_path / "rewards.py", GOOD)
    identity = resolve("./rewards.py:score", tmp_path).identity
    before = sha256_file(path)
    path.write_text(GOOD + "\n# tuned\n")
    after = sha256_file(path)
    (issue,) = plugin_changes(identity)
    assert issue.path == USED_BY
    assert str(path.resolve()) in issue.message
    assert f"changed since planning (sha256 {before[:8]}… → {after[:8]}…)" in issue.message


def test_deleted_file_is_reported(tmp_path):
    path = write(tmp_path / "rewards.py", GOOD)
    identity = resolve("./rewards.py:score", tmp_path).identity
    path.unlink()
    (issue,) = plugin_changes(identity)
    assert issue.message == f"file {path.resolve()} no longer exists"


def test_distribution_version_change_is_reported(tmp_path, installed_dist):
    identity = resolve("rp_ep_score", tmp_path).identity
    (upgraded,) = plugin_changes(identity, version_of=lambda name: "1.1")
    assert upgraded.message == "rp-dist 1.0 → 1.1"
    (removed,) = plugin_changes(identity, version_of=lambda name: None)
    assert removed.message == "rp-dist is no longer installed (was 1.0)"


def test_freshness_does_not_import_the_plugin(tmp_path, package_dir):
    identity = resolve("rp_pkg.scoring:score", tmp_path).identity
    del sys.modules["rp_pkg.scoring"]
    (package_dir / "rp_pkg" / "scoring.py").write_text(GOOD + "raise SystemExit('imported')\n")
    (issue,) = plugin_changes(identity)
    assert "changed since planning" in issue.message
    assert "rp_pkg.scoring" not in sys.modules
