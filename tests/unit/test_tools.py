"""The tool harness: calls parsed from answers (good, malformed, unknown tool, bad arguments),
each built-in tool run for real (python and shell in the sandbox, files in a real directory,
http_get against a real server on 127.0.0.1), and user functions as tools."""

from __future__ import annotations

import http.server
import socket
import threading

import pytest

from rollout.harness.sandbox import probe_sandbox
from rollout.harness.tools import (
    BUILTIN_TOOLS,
    BadCall,
    Toolbox,
    ToolCall,
    ToolContext,
    ToolError,
    function_schema,
    parse_calls,
    plugin_tool,
)
from rollout.harness.tools.calculator import evaluate

# --- parsing -------------------------------------------------------------------------------------


def test_hermes_calls_are_read_in_order_and_text_around_them_is_ignored():
    text = (
        'Let me compute. <tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}'
        '</tool_call> and <tool_call>\n{"name": "python", "arguments": "{\\"code\\": \\"1\\"}"}\n'
        "</tool_call>"
    )
    assert parse_calls(text, "hermes") == [
        ToolCall("calculator", {"expression": "2+3"}),
        ToolCall("python", {"code": "1"}),  # arguments as a JSON string, as OpenAI sends them
    ]


def test_an_answer_without_a_call_is_final():
    assert parse_calls("The answer is 42.", "hermes") == []
    assert parse_calls("The answer is 42.", "json") == []


def test_a_call_cut_off_before_its_closing_tag_still_counts():
    text = '<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}'
    assert parse_calls(text, "hermes") == [ToolCall("calculator", {"expression": "1"})]


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ('{"name": "calculator", "arguments": {"expression": "1"', "not valid JSON"),
        ("[1, 2]", "is a JSON object"),
        ('{"arguments": {}}', 'no "name"'),
        ('{"name": "calculator", "arguments": [1]}', "must be a JSON object"),
        ('{"name": "calculator", "arguments": "{nope"}', "string that is not JSON"),
    ],
)
def test_malformed_calls_become_problems_for_the_model(body, says):
    [call] = parse_calls(f"<tool_call>{body}</tool_call>", "hermes")
    assert isinstance(call, BadCall) and says in call.problem


def test_the_json_format_reads_a_whole_answer_object_with_or_without_a_fence():
    call = ToolCall("calculator", {"expression": "6*7"})
    assert parse_calls('{"name": "calculator", "arguments": {"expression": "6*7"}}', "json") == [
        call
    ]
    fenced = '```json\n{"name": "calculator", "parameters": {"expression": "6*7"}}\n```'
    assert parse_calls(fenced, "json") == [call]
    [bad] = parse_calls("{name: calculator}", "json")
    assert isinstance(bad, BadCall)


def test_too_many_calls_in_one_answer_are_refused_past_the_limit():
    one = '<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}</tool_call>'
    calls = parse_calls(one * 10, "hermes")
    assert len(calls) == 10 and [isinstance(c, BadCall) for c in calls].count(True) == 2


# --- the toolbox -----------------------------------------------------------------------------------


@pytest.fixture
def context(tmp_path):
    return ToolContext(tmp_path)


def test_the_toolbox_tells_unknown_tools_and_bad_arguments_apart(context):
    box = Toolbox([BUILTIN_TOOLS["calculator"]()])
    good = box.run(ToolCall("calculator", {"expression": "12*(3+4)"}), context)
    assert good.valid and good.text == "84"
    unknown = box.run(ToolCall("calculater", {"expression": "1"}), context)
    assert not unknown.valid and "no tool 'calculater' (tools: calculator)" in unknown.text
    missing = box.run(ToolCall("calculator", {}), context)
    assert not missing.valid and "'expression' is a required property" in missing.text
    typed = box.run(ToolCall("calculator", {"expression": 7}), context)
    assert (
        not typed.valid and "at 'expression'" in typed.text and "not of type 'string'" in typed.text
    )
    extra = box.run(ToolCall("calculator", {"expression": "1", "x": 1}), context)
    assert not extra.valid and "Additional properties" in extra.text
    refused = box.run(ToolCall("calculator", {"expression": "import os"}), context)
    assert refused.valid and refused.text.startswith("error: ")  # a valid call the tool declines


def test_the_toolbox_describes_its_tools_in_the_chosen_format():
    box = Toolbox([BUILTIN_TOOLS["calculator"](), BUILTIN_TOOLS["list_files"]()])
    hermes = box.instructions("hermes")
    assert '"name": "calculator"' in hermes and '"name": "list_files"' in hermes
    assert "<tool_call>" in hermes and "<tool_call>" not in box.instructions("json")
    example = '{"name": "calculator", "arguments": {"expression": "12 * 34"}}'
    assert f"for example:\n<tool_call>{example}</tool_call>\n" in hermes
    assert parse_calls(example, "json") == [ToolCall("calculator", {"expression": "12 * 34"})]


def test_two_tools_with_one_name_are_refused():
    with pytest.raises(ValueError, match="two tools are named calculator"):
        Toolbox([BUILTIN_TOOLS["calculator"](), BUILTIN_TOOLS["calculator"]()])


# --- calculator ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("1 + 2 * 3", 7),
        ("(1 + 2) * 3", 9),
        ("7 / 2", 3.5),
        ("7 // 2", 3),
        ("-7 % 3", 2),
        ("2 ** 10", 1024),
        ("2 ** -1", 0.5),
        ("123 * 456", 56088),
        ("1.5e3 + 1", 1501.0),
    ],
)
def test_the_calculator_computes_arithmetic(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize(
    ("expression", "says"),
    [
        ("9 ** 9 ** 9", "digits, more than 100"),
        ("10 ** 101", "digits, more than 100"),
        ("(10 ** 60) * (10 ** 60)", "more than 100 digits"),
        ("10.0 ** 400", "digits"),
        ("1.5 ** 1e6", "too large"),
        ("1 / 0", "division by zero"),
        ("(-8) ** 0.5", "not a real number"),
        ("__import__('os').system('ls')", "a function call"),
        ("x + 1", "the name 'x'"),
        ("(1).real", "attribute syntax"),
        ("[1, 2]", "list syntax"),
        ("'a' * 3", "is not a number"),
        ("True + 1", "is not a number"),
        ("1 < 2", "compare syntax"),
        ("1 +", "is not an arithmetic expression"),
        ("1" * 201, "more than 200"),
    ],
)
def test_the_calculator_refuses_what_is_not_bounded_arithmetic(expression, says):
    with pytest.raises(ToolError, match=says):
        evaluate(expression)


def test_calculator_results_read_as_numbers(context):
    tool = BUILTIN_TOOLS["calculator"]()
    assert tool.run({"expression": "6 / 3"}, context) == "2"
    assert tool.run({"expression": "1 / 3"}, context) == "0.333333333333"


# --- sandboxed tools -------------------------------------------------------------------------------

REPORT = probe_sandbox()
needs_isolation = pytest.mark.skipif(
    not REPORT.works("network isolation"), reason="this host has no network namespaces"
)


@needs_isolation
def test_python_runs_code_in_the_episode_directory(context):
    tool = BUILTIN_TOOLS["python"](wall_s=5)
    assert tool.runs_code
    assert tool.run({"code": "open('a.txt', 'w').write('hi')\nprint(6 * 7)"}, context) == "42"
    assert (context.workdir / "a.txt").read_text() == "hi"
    failed = tool.run({"code": "raise ValueError('no')"}, context)
    assert "ValueError: no" in failed and "exit code 1" in failed


@needs_isolation
def test_python_is_stopped_at_its_limits_and_cannot_reach_the_network(context):
    tool = BUILTIN_TOOLS["python"](wall_s=1, cpu_s=1)
    assert "stopped:" in tool.run({"code": "while True: pass"}, context)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('reached the host')"
        reached = tool.run({"code": code}, context)
    assert "Network is unreachable" in reached and "reached the host" not in reached


@needs_isolation
def test_shell_runs_allowed_programs_only(context):
    (context.workdir / "notes.txt").write_text("x")
    tool = BUILTIN_TOOLS["shell"](allowed=["ls"])
    assert tool.run({"command": "ls"}, context) == "notes.txt"
    box = Toolbox([tool])
    refused = box.run(ToolCall("shell", {"command": "rm notes.txt"}), context)
    assert "'rm' is not allowed (allowed: ls)" in refused.text
    assert (context.workdir / "notes.txt").exists()


def test_shell_needs_an_allow_list():
    with pytest.raises(ValueError, match="at least one program"):
        BUILTIN_TOOLS["shell"](allowed=[])
    with pytest.raises(ValueError, match="bare names"):
        BUILTIN_TOOLS["shell"](allowed=["/bin/sh"])


def test_file_tools_stay_in_the_episode_directory(context):
    box = Toolbox([BUILTIN_TOOLS[name]() for name in ("read_file", "write_file", "list_files")])
    wrote = box.run(ToolCall("write_file", {"path": "d/a.txt", "content": "hello"}), context)
    assert wrote.text == "wrote 5 bytes to d/a.txt"
    assert box.run(ToolCall("read_file", {"path": "d/a.txt"}), context).text == "hello"
    assert box.run(ToolCall("list_files", {}), context).text == "d/"
    outside = box.run(ToolCall("read_file", {"path": "../../etc/passwd"}), context)
    assert "leads outside the workspace" in outside.text
    absolute = box.run(ToolCall("write_file", {"path": "/tmp/x", "content": ""}), context)
    assert "is absolute" in absolute.text


@pytest.fixture
def server():
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = b"page " + self.path.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd.server_address[1]
    httpd.shutdown()
    httpd.server_close()
    thread.join()


def test_http_get_fetches_allowed_hosts_only(context, server):
    tool = BUILTIN_TOOLS["http_get"](allowed_hosts=["127.0.0.1"])
    assert tool.run({"url": f"http://127.0.0.1:{server}/a"}, context) == "status 200\npage /a"
    box = Toolbox([tool])
    refused = box.run(ToolCall("http_get", {"url": f"http://localhost:{server}/"}), context)
    assert refused.text.startswith("error: ") and "localhost" in refused.text


# --- user functions ----------------------------------------------------------------------------------


def lookup(city: str) -> dict:
    return {"city": city, "population": len(city) * 1000}


lookup.schema = {
    "name": "lookup",
    "description": "A city's population.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


def test_a_user_function_is_a_tool_with_its_schema_attribute_or_the_configs(context):
    tool = plugin_tool(lookup, None, "environment.tools[0].function")
    assert tool.name == "lookup" and not tool.runs_code
    assert tool.run({"city": "Oslo"}, context) == '{"city": "Oslo", "population": 4000}'
    declared = {"type": "function", "function": {**lookup.schema, "name": "population"}}
    assert plugin_tool(lookup, declared, "here").name == "population"


@pytest.mark.parametrize(
    ("schema", "says"),
    [
        (None, "has no schema"),
        ({"name": "a b"}, "letters, digits"),
        ({"name": "x", "parameters": {"type": "array"}}, "type 'object'"),
        ({"name": "x", "parameters": {"type": "object", "required": 3}}, "not a valid JSON Schema"),
        ({"name": "x", "params": {}}, "unknown key"),
    ],
)
def test_a_function_tool_needs_a_valid_declaration(schema, says):
    def bare(**_):
        return ""

    with pytest.raises(ValueError, match=says):
        plugin_tool(bare, schema, "environment.tools[0].function")


def test_a_function_tools_first_schema_example_is_shown_to_the_model():
    parameters = {**lookup.schema["parameters"], "examples": [{"city": "Oslo"}]}
    tool = plugin_tool(lookup, {**lookup.schema, "parameters": parameters}, "here")
    assert tool.example == {"city": "Oslo"}
    assert '<tool_call>{"name": "lookup", "arguments": {"city": "Oslo"}}' in Toolbox(
        [tool]
    ).instructions("hermes")


def test_function_schema_accepts_the_openai_tools_entry():
    entry = {"type": "function", "function": lookup.schema}
    assert function_schema(entry, "x")[0] == "lookup"
