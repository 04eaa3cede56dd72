"""`rollout plugins new KIND NAME`: a package holding one working plugin of a kind, with its entry
point, a sample for `rollout plugins test`, and a test of its own.

    NAME/
      pyproject.toml          the entry point NAME in the kind's group (rollout.plugins.registry)
      README.md               install, test, use
      sample.jsonl            input for `rollout plugins test NAME --kind KIND --sample ...`
      src/NAME/__init__.py    the plugin
      tests/test_NAME.py      passes with `pytest` (PYTHONPATH=src, or once installed)

The templates use only the standard library (an environment also imports rollout's StepResult),
so the package's own test runs wherever rollout is installed.
"""

from __future__ import annotations

import json
import keyword
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

from rollout.errors import Issue, RolloutError
from rollout.plugins.registry import KINDS


@dataclass(frozen=True)
class _Template:
    attr: str
    """The plugin's name in its module: {name} or {camel} filled in."""
    module: str
    test: str
    sample: list[dict[str, object]]


_TEMPLATES = {
    "reward": _Template(
        "{name}",
        '''
        """{name}: a reward plugin (group rollout.rewards). rollout calls it as
        {name}(prompts, completions, **fields, **options) and wants one float per completion."""


        def {name}(
            prompts: list[str], completions: list[str], answer: list[str], **kwargs
        ) -> list[float]:
            """1.0 where the completion contains the row's answer, else 0.0. `answer` is a dataset
            field (one entry per completion); **kwargs takes the fields and options it does not use."""
            return [
                1.0 if str(expected).strip() in completion else 0.0
                for completion, expected in zip(completions, answer)
            ]
        ''',
        """
        from {name} import {name}


        def test_scores_one_float_per_completion():
            scores = {name}(["2+2?", "3+3?"], ["it is 4", "it is 7"], answer=["4", "6"])
            assert scores == [1.0, 0.0]
        """,
        [
            {"prompt": "What is 2+2?", "completion": "It is 4.", "answer": "4"},
            {"prompt": "What is 3+3?", "completion": "It is 7.", "answer": "6"},
        ],
    ),
    "environment": _Template(
        "{camel}",
        '''
        """{name}: an environment plugin (group rollout.environments). rollout calls {camel}(**options)
        once, then reset(rows, seed=...) and step(episodes, actions) on batches of episodes."""

        from rollout.harness.environments.base import StepResult


        class {camel}:
            """Asks the model to repeat the row's `word`; an episode ends when it does (reward 1.0)
            or after `max_turns` answers."""

            def __init__(self, max_turns: int = 3):
                self.max_turns = max_turns
                self.words: list[str] = []
                self.turns: list[int] = []

            def reset(self, rows, *, seed):
                self.words = [str(row["word"]) for row in rows]
                self.turns = [0] * len(rows)
                return [f"Say the word {{word!r}} and nothing else." for word in self.words]

            def step(self, episodes, actions):
                results = []
                for episode, action in zip(episodes, actions):
                    self.turns[episode] += 1
                    right = action.strip().strip(".").lower() == self.words[episode].lower()
                    done = right or self.turns[episode] >= self.max_turns
                    results.append(
                        StepResult(
                            observation="" if done else "No. Say only the word.",
                            reward=1.0 if right else 0.0,
                            done=done,
                            info={{"right": right}},
                        )
                    )
                return results
        ''',
        """
        from {name} import {camel}


        def test_an_episode_ends_when_the_word_is_said():
            environment = {camel}(max_turns=2)
            first = environment.reset([{{"word": "apple"}}, {{"word": "pear"}}], seed=0)
            assert "apple" in first[0] and "pear" in first[1]
            wrong, right = environment.step([0, 1], ["banana", "Pear."])
            assert (wrong.done, wrong.reward) == (False, 0.0)
            assert (right.done, right.reward) == (True, 1.0)
            (last,) = environment.step([0], ["plum"])
            assert last.done  # max_turns reached
        """,
        [
            {"row": {"word": "apple"}, "actions": ["banana", "apple"]},
            {"row": {"word": "pear"}, "actions": ["Pear."]},
        ],
    ),
    "tool": _Template(
        "{name}",
        '''
        """{name}: a tool plugin (group rollout.tools). rollout calls {name}(**arguments) with the
        model's arguments (checked against `schema` first) and gives the model what it returns."""


        def {name}(text: str) -> str:
            """How many words `text` has."""
            return str(len(text.split()))


        {name}.schema = {{
            "name": "{name}",
            "description": "Count the words in a text.",
            "parameters": {{
                "type": "object",
                "properties": {{"text": {{"type": "string", "description": "the text"}}}},
                "required": ["text"],
                "additionalProperties": False,
            }},
        }}
        ''',
        """
        from {name} import {name}


        def test_counts_words():
            assert {name}(text="one two  three") == "3"
            assert {name}.schema["parameters"]["required"] == ["text"]
        """,
        [{"text": "the quick brown fox"}, {"text": ""}],
    ),
    "scorer": _Template(
        "{name}",
        '''
        """{name}: an eval scorer plugin (group rollout.scorers). rollout calls {name}(row, completion)
        for each completion and wants a score in [0, 1] (or a bool); 1 counts as correct."""


        def {name}(record: dict, completion: str) -> float:
            """1.0 when the completion, trimmed, is the row's answer (ignoring case)."""
            return float(completion.strip().lower() == str(record["answer"]).strip().lower())
        ''',
        """
        from {name} import {name}


        def test_exact_answer_scores_one():
            assert {name}({{"prompt": "Capital of France?", "answer": "Paris"}}, " paris ") == 1.0
            assert {name}({{"prompt": "Capital of France?", "answer": "Paris"}}, "Lyon") == 0.0
        """,
        [
            {"prompt": "Capital of France?", "answer": "Paris", "completion": "Paris"},
            {"prompt": "Capital of Italy?", "answer": "Rome", "completion": "Milan"},
        ],
    ),
    "tracker": _Template(
        "{name}",
        '''
        """{name}: a metric tracker plugin (group rollout.trackers). rollout calls
        {name}(run_id=..., run_dir=...) once, on the recording worker's first rows, then log(rows)
        with each batch of metric rows (each has .step, .name, .value and .time) and close()."""

        import json
        import os


        class {camel}:
            """Appends every row to <run_dir>/{name}.jsonl as one JSON object a line."""

            def __init__(self, run_id: str, run_dir: str):
                self.run_id = run_id
                self.path = os.path.join(run_dir, "{name}.jsonl")

            def log(self, rows) -> None:
                with open(self.path, "a", encoding="utf-8") as file:
                    for row in rows:
                        line = {{"step": row.step, "name": row.name, "value": row.value}}
                        file.write(json.dumps(line) + "\\n")

            def close(self) -> None:
                pass


        def {name}(run_id: str, run_dir: str) -> {camel}:
            return {camel}(run_id, run_dir)
        ''',
        """
        import json
        from types import SimpleNamespace

        from {name} import {name}


        def test_every_row_is_written(tmp_path):
            tracker = {name}(run_id="r1", run_dir=str(tmp_path))
            tracker.log([SimpleNamespace(step=1, name="reward/mean", value=0.5, time=0.0)])
            tracker.close()
            lines = (tmp_path / "{name}.jsonl").read_text().splitlines()
            assert [json.loads(line) for line in lines] == [
                {{"step": 1, "name": "reward/mean", "value": 0.5}}
            ]
        """,
        [
            {"step": 1, "name": "reward/mean", "value": 0.25},
            {"step": 2, "name": "reward/mean", "value": 0.5},
        ],
    ),
    "engine": _Template(
        "{name}",
        """
        \"\"\"{name}: an engine plugin (group rollout.engines). rollout calls {name}(spec) once per
        engine with a rollout.engines.plugin.EngineSpec (the model, tokenizer, device, ...) and
        wants an Engine back: generate(prompts, params), load_weights(weights, version), close(),
        and the properties policy_version and stats (rollout.engines.base.Engine).

        This one wraps the built-in hf engine and adds a stop rule: every completion also ends at
        a blank line, whatever the request's own stop strings are; it logs each call.\"\"\"

        import dataclasses
        import logging

        from rollout.engines.plugin import WrappedEngine

        log = logging.getLogger(__name__)

        BLANK_LINE = "\\n\\n"


        class {camel}(WrappedEngine):
            # Every member goes to the hf engine (WrappedEngine) but generate.

            def generate(self, prompts, params):
                stop = tuple(dict.fromkeys((*params.stop, BLANK_LINE)))
                completions = self.inner.generate(prompts, dataclasses.replace(params, stop=stop))
                tokens = sum(len(completion.token_ids) for completion in completions)
                log.info("{name}: %d prompt(s) -> %d token(s)", len(prompts), tokens)
                return completions


        def {name}(spec) -> {camel}:
            return {camel}(spec.hf_engine())
        """,
        """
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from rollout.engines.base import SamplingParams
        from rollout.engines.plugin import EngineSpec
        from rollout.models.builtin_build import builtin_model_dir

        from {name} import BLANK_LINE, {name}


        def test_it_generates_with_the_tiny_model_and_stops_at_a_blank_line():
            directory = builtin_model_dir("tiny-llama")
            tokenizer = AutoTokenizer.from_pretrained(directory)
            spec = EngineSpec(
                model=AutoModelForCausalLM.from_pretrained(directory),
                tokenizer=tokenizer,
                eos_token_ids=[tokenizer.eos_token_id],
                pad_token_id=tokenizer.pad_token_id or 0,
                device="cpu",
                max_batch_size=4,
                seed=0,
            )
            engine = {name}(spec)
            prompt = tokenizer.encode("1+1=")
            completions = engine.generate([prompt], SamplingParams(max_new_tokens=8, n=2, seed=0))
            assert len(completions) == 2
            for completion in completions:
                assert len(completion.logprobs) == len(completion.token_ids) <= 8
                assert BLANK_LINE not in completion.text
            engine.close()
        """,
        [{"prompt": "1+1="}, {"prompt": "The answer is", "n": 2, "temperature": 1.0}],
    ),
}

SCAFFOLD_KINDS = tuple(_TEMPLATES)


@dataclass(frozen=True)
class Scaffold:
    files: list[Path]
    target: str
    """The plugin as 'module:attr' (what the entry point points at)."""


def write_scaffold(kind: str, name: str, directory: Path) -> Scaffold:
    """Write the package for plugin ``name`` of ``kind`` into ``directory`` (new, or empty).
    RolloutError for a kind without a template, a name that cannot be a
    package, or a directory in use."""
    template = _check(kind, name, directory)
    camel = "".join(part.capitalize() for part in name.split("_")) or name
    attr = template.attr.format(name=name, camel=camel)
    group = KINDS[kind].group
    files = {
        "pyproject.toml": _pyproject(name, group or "", attr),
        "README.md": _readme(kind, name, group or ""),
        "sample.jsonl": "".join(json.dumps(item) + "\n" for item in template.sample),
        f"src/{name}/__init__.py": _fill(template.module, name, camel),
        f"tests/test_{name}.py": _fill(template.test, name, camel),
    }
    written = []
    for relative, text in files.items():
        path = directory / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return Scaffold(written, f"{name}:{attr}")


def _check(kind: str, name: str, directory: Path) -> _Template:
    if kind not in _TEMPLATES:
        why = f"there is no plugin kind {kind!r}"
        raise RolloutError(Issue("KIND", why, value=kind, hint=f"one of: {', '.join(_TEMPLATES)}"))
    if not name.isidentifier() or keyword.iskeyword(name) or not name.isascii():
        raise RolloutError(
            Issue(
                "NAME",
                "is not a valid Python identifier: it names the package, its module and the "
                "entry point",
                value=name,
                hint="use letters, digits and underscores, not starting with a digit "
                f"(e.g. {_suggest(name)!r})",
            )
        )
    if name in sys.stdlib_module_names or name == "rollout":
        raise RolloutError(
            Issue(
                "NAME",
                "is the name of an existing module, which the package would hide",
                value=name,
                hint=f"choose another, e.g. 'my_{name}'",
            )
        )
    if name in KINDS[kind].load_builtins():
        raise RolloutError(
            Issue(
                "NAME",
                f"is a built-in {kind}: a config naming it would get the built-in, "
                "never this entry point",
                value=name,
                hint=f"choose another, e.g. 'my_{name}'",
            )
        )
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise RolloutError(
            Issue(
                str(directory),
                "exists and is not an empty directory: nothing was written",
                hint="choose a new directory with --dir, or remove this one",
            )
        )
    return _TEMPLATES[kind]


def _suggest(name: str) -> str:
    cleaned = "".join(c if c.isascii() and (c.isalnum() or c == "_") else "_" for c in name)
    cleaned = cleaned.strip("_") or "my_plugin"
    return f"p_{cleaned}" if cleaned[0].isdigit() or keyword.iskeyword(cleaned) else cleaned


def _fill(template: str, name: str, camel: str) -> str:
    return textwrap.dedent(template).lstrip().format(name=name, camel=camel)


def _pyproject(name: str, group: str, attr: str) -> str:
    return textwrap.dedent(
        f"""\
        [build-system]
        requires = ["setuptools>=61"]
        build-backend = "setuptools.build_meta"

        [project]
        name = "{name.replace("_", "-")}"
        version = "0.1.0"
        description = "A rollout plugin."
        requires-python = ">=3.10"
        dependencies = ["rollout"]

        # The entry point rollout finds the plugin by: a config names it as "{name}".
        [project.entry-points."{group}"]
        {name} = "{name}:{attr}"

        [tool.setuptools.packages.find]
        where = ["src"]

        [tool.pytest.ini_options]
        pythonpath = ["src"]
        """
    )


def _readme(kind: str, name: str, group: str) -> str:
    configured = KINDS[kind].configured_by
    return textwrap.dedent(
        f"""\
        # {name}

        A rollout {kind} plugin, installed under the entry point `{name}` in the group `{group}`.

            pip install -e .                  # rollout now finds it by name
            rollout plugins list --kind {kind}   # shows {name}, "entry point {name.replace("_", "-")}"
            rollout plugins test {name} --kind {kind} --sample sample.jsonl
            pytest                            # its own test (installed or not)

        Name it in a run config where {configured} is set: `"{name}"`. Without installing,
        `"{name}:…"` works too with `src` on PYTHONPATH. See rollout's docs/plugins.md.
        """
    )
