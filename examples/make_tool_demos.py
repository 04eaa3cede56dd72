"""Demonstrations for a tools run's SFT warm-up (docs/tools.md), rendered exactly as the tools
environment renders an episode: the first message (the calculator's declaration and the task),
the assistant's call, the tool's result, the assistant's answer.

    python make_tool_demos.py data/products-train.jsonl data/products-demos.jsonl
"""

from __future__ import annotations

import json
import re
import sys

from rollout.harness.environments.tools import first_message
from rollout.harness.tools.calculator import calculator
from rollout.harness.tools.calls import Toolbox


def demonstration(instructions: str, row: dict[str, str]) -> dict[str, list[dict[str, str]]]:
    expression = re.search(r"What is (.+?)\?", row["prompt"])
    if expression is None:
        raise SystemExit(f"no 'What is ...?' in {row['prompt']!r}")
    call = json.dumps({"name": "calculator", "arguments": {"expression": expression[1]}})
    return {
        "messages": [
            {"role": "user", "content": first_message(instructions, row["prompt"])},
            {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
            {"role": "tool", "content": row["answer"]},
            {"role": "assistant", "content": row["answer"]},
        ]
    }


def main(source: str, target: str) -> None:
    # The same declarations and call format as the run's [environment] (tool_format "hermes").
    instructions = Toolbox([calculator()]).instructions("hermes")
    with open(source) as rows, open(target, "w") as out:
        for line in rows:
            out.write(json.dumps(demonstration(instructions, json.loads(line))) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:3])
