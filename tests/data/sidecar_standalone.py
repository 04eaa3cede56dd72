"""A sidecar written against schemas/sidecar-protocol.schema.json alone: the standard library,
no rollout. It scores each completion by its length (times the option `scale`).

    python sidecar_standalone.py [--log FILE] [--crash-once MARKER]

--log: append each call id it receives to FILE; --crash-once: exit on its first call unless
MARKER exists (creating it), as a crash would, so the host must restart it and resubmit.
"""

import json
import os
import struct
import sys


def read(stream):
    head = stream.read(4)
    if len(head) < 4:
        return None
    (length,) = struct.unpack(">I", head)
    return json.loads(stream.read(length).decode("utf-8"))


def write(stream, message):
    body = json.dumps(message).encode("utf-8")
    stream.write(struct.pack(">I", len(body)) + body)
    stream.flush()


def main():
    args = sys.argv[1:]
    log = args[args.index("--log") + 1] if "--log" in args else None
    marker = args[args.index("--crash-once") + 1] if "--crash-once" in args else None
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    write(
        out,
        {
            "type": "hello",
            "protocol": "rollout-sidecar",
            "version": 1,
            "plugin": "standalone:length",
            "pid": os.getpid(),
            "parameters": [
                {"name": "prompts", "kind": "POSITIONAL_OR_KEYWORD"},
                {"name": "completions", "kind": "POSITIONAL_OR_KEYWORD"},
                {"name": "scale", "kind": "KEYWORD_ONLY", "has_default": True},
            ],
        },
    )
    while True:
        message = read(inp)
        if message is None or message["type"] == "shutdown":
            return
        if message["type"] == "ping":
            write(out, {"type": "pong", "id": message["id"]})
            continue
        if log:
            with open(log, "a") as f:
                f.write(f"{message['id']}\n")
        if marker and not os.path.exists(marker):
            open(marker, "w").close()
            os._exit(7)
        _prompts, completions = message["args"]
        scale = message["kwargs"].get("scale", 1.0)
        if scale < 0:
            write(
                out,
                {
                    "type": "error",
                    "id": message["id"],
                    "kind": "ValueError",
                    "message": "scale must not be negative",
                },
            )
            continue
        write(
            out,
            {"type": "result", "id": message["id"], "value": [scale * len(c) for c in completions]},
        )


if __name__ == "__main__":
    main()
