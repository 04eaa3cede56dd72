"""The registry of plugin kinds: each kind's built-ins are what a config can name, its Protocol
exists, installed entry points are listed (without importing them), and listing costs no torch.

Entry points are real: a dist-info folder on sys.path that importlib.metadata reads."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import get_args

import pytest

from rollout.config.generation import BUILTIN_ENGINES
from rollout.config.logging import Tracker
from rollout.harness.environments import BUILTIN_ENVIRONMENTS
from rollout.harness.eval.scorers import SCORERS
from rollout.harness.rewards import BUILTIN_REWARDS
from rollout.harness.tools import BUILTIN_TOOLS
from rollout.plugins.registry import KINDS, available, kind
from tests.conftest import REPO


def install(site: Path, dist: str, version: str, groups: dict[str, dict[str, str]]) -> None:
    """A distribution DIST at VERSION whose entry points are groups {group: {name: target}}."""
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    text = "".join(
        f"[{group}]\n" + "".join(f"{name} = {target}\n" for name, target in entries.items())
        for group, entries in groups.items()
    )
    (info / "entry_points.txt").write_text(text)


def names(kind_name: str) -> set[str]:
    return {p.name for p in available([kind_name]) if p.source == "builtin"}


def test_every_kind_lists_the_names_a_config_accepts_without_a_plugin():
    assert names("reward") == set(BUILTIN_REWARDS)
    assert names("tool") == set(BUILTIN_TOOLS)
    assert names("scorer") == set(SCORERS)
    # the environments the run builds itself (from rewards, tools, an agent command) too
    assert names("environment") == set(BUILTIN_ENVIRONMENTS) | {"single_turn", "tools", "agent"}
    assert names("engine") == set(BUILTIN_ENGINES)
    assert names("tracker") == set(get_args(Tracker))


def test_builtins_are_listed_with_rollouts_version_and_what_they_are():
    (listed,) = [p for p in available(["reward"]) if p.name == "numeric_match"]
    assert listed.source == "builtin"
    assert listed.target == "rollout.harness.rewards:numeric_match"
    from rollout.version import __version__

    assert listed.version == __version__


@pytest.mark.parametrize("name", sorted(KINDS))
def test_every_kind_points_at_a_protocol(name):
    protocol = kind(name).load_protocol()
    assert getattr(protocol, "_is_protocol", False), f"{protocol} is not a typing.Protocol"


def test_the_groups_are_the_ones_plugins_were_installed_under():
    # Renaming a group would silently lose every installed plugin of that kind.
    groups = {name: plugin_kind.group for name, plugin_kind in KINDS.items()}
    assert groups == {
        "reward": "rollout.rewards",
        "environment": "rollout.environments",
        "tool": "rollout.tools",
        "scorer": "rollout.scorers",
        "engine": "rollout.engines",
        "tracker": "rollout.trackers",
    }


def test_an_unknown_kind_names_the_kinds():
    with pytest.raises(KeyError, match="reward, environment, tool, scorer, engine, tracker"):
        kind("rewards")


def test_installed_entry_points_are_listed_with_their_distribution_and_version(
    tmp_path, monkeypatch
):
    site = tmp_path / "site"
    # the module raises when imported: listing reads metadata, it must not import
    (site / "acme_plugins.py").parent.mkdir(parents=True)
    (site / "acme_plugins.py").write_text("raise RuntimeError('imported')\n")
    install(
        site,
        "acme-plugins",
        "2.3.1",
        {
            "rollout.rewards": {"acme_reward": "acme_plugins:score"},
            "rollout.environments": {"acme_env": "acme_plugins:Env"},
            "rollout.tools": {"acme_tool": "acme_plugins:tool"},
            "rollout.scorers": {"acme_scorer": "acme_plugins:scorer"},
        },
    )
    monkeypatch.syspath_prepend(str(site))
    found = {(p.kind, p.name): p for p in available() if p.source != "builtin"}
    assert set(found) >= {
        ("reward", "acme_reward"),
        ("environment", "acme_env"),
        ("tool", "acme_tool"),
        ("scorer", "acme_scorer"),
    }
    listed = found[("tool", "acme_tool")]
    assert (listed.source, listed.version, listed.target) == (
        "entry point acme-plugins",
        "2.3.1",
        "acme_plugins:tool",
    )
    assert "acme_plugins" not in sys.modules


def test_the_planner_resolves_an_entry_point_of_the_registrys_group(tmp_path, monkeypatch):
    from rollout.planner.tools import GROUP
    from rollout.plugins.resolve import resolve_plugin

    site = tmp_path / "site"
    site.mkdir()
    (site / "acme_tools.py").write_text("def shout(text):\n    return text.upper()\n")
    install(site, "acme-tools", "1.0", {KINDS["tool"].group: {"shout": "acme_tools:shout"}})
    monkeypatch.syspath_prepend(str(site))
    assert KINDS["tool"].group == GROUP
    resolved = resolve_plugin(
        "shout", base_dir=tmp_path, used_by="t", group=GROUP, builtins=BUILTIN_TOOLS
    )
    assert resolved.fn("hi") == "HI"
    assert resolved.identity.distribution == "acme-tools"
    sys.modules.pop("acme_tools", None)


def test_listing_every_kind_imports_no_torch():
    code = textwrap.dedent(
        """
        import sys
        from rollout.plugins.registry import available
        listed = available()
        assert {p.kind for p in listed} == {"reward", "environment", "tool", "scorer", "engine",
                                            "tracker"}, listed
        heavy = sorted(m for m in ("torch", "transformers", "vllm") if m in sys.modules)
        assert not heavy, heavy
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr


def test_the_config_and_build_engine_name_the_same_builtin_engines():
    from rollout.engines.build import ENGINES

    assert set(ENGINES) == set(BUILTIN_ENGINES)
