"""An MCP server over stdio that speaks raw JSON-RPC, to misbehave in ways the SDK's server never
would. argv[1] picks how: ``latin1-once`` (the first call's answer is not UTF-8), ``image`` (an
"image" that is HTML), ``big-struct`` (structured output of megabytes), ``refuse`` (exits at start,
saying on stderr what its command line held), ``odd-tools`` (tool names a provider refuses
as they are; a call answers with the tool's name and arguments)."""

from __future__ import annotations

import json
import sys

MODE = sys.argv[1]
out = sys.stdout.buffer


def answer(request_id: int, result: dict) -> None:
    out.write(json.dumps({"jsonrpc": "2.0", "id": request_id, "result": result}).encode() + b"\n")
    out.flush()


if MODE == "refuse":
    sys.stderr.write(f"cannot log in with {sys.argv[-1]}\n")
    sys.exit(1)

ODD_TOOLS = [  # names a provider refuses as they are, or that clash once made into ones it takes
    {"name": "get.user", "inputSchema": {"type": "object"}},
    {"name": "get_user", "inputSchema": {"type": "object", "properties": {"id": {"type": "string"}}}},
    {"name": "x" * 70 + "1", "inputSchema": {"type": "object"}},  # past 64 characters, sharing
    {"name": "x" * 70 + "2", "inputSchema": {"type": "object"}},  # their first 64 with each other
    {"name": "", "inputSchema": {"type": "object"}},
]
calls = 0
for line in sys.stdin.buffer:
    message = json.loads(line)
    request_id, method = message.get("id"), message.get("method")
    if request_id is None:
        continue
    if method == "initialize":
        info = {"name": "raw", "version": "1"}
        version = message["params"]["protocolVersion"]
        answer(request_id, {"protocolVersion": version, "capabilities": {"tools": {}}, "serverInfo": info})
    elif method == "tools/list":
        if MODE == "odd-tools":
            answer(request_id, {"tools": ODD_TOOLS})
        else:
            answer(request_id, {"tools": [{"name": "get", "description": "Get.", "inputSchema": {"type": "object"}}]})
    elif method == "tools/call":
        calls += 1
        if MODE == "odd-tools":
            echo = json.dumps([message["params"]["name"], message["params"].get("arguments")])
            answer(request_id, {"content": [{"type": "text", "text": echo}]})
        elif MODE == "latin1-once" and calls == 1:
            body = b'{"jsonrpc":"2.0","id":%d,"result":{"content":[{"type":"text","text":"caf\xe9"}]}}\n' % request_id
            out.write(body)
            out.flush()
        elif MODE == "image":
            answer(request_id, {"content": [{"type": "image", "data": "not base64!!", "mimeType": "text/html"}]})
        elif MODE == "big-struct":
            big = {"blob": "B" * 300_000}
            answer(request_id, {"content": [{"type": "text", "text": "ok"}], "structuredContent": big})
        else:
            answer(request_id, {"content": [{"type": "text", "text": f"call {calls}"}]})
    else:
        out.write(json.dumps({"jsonrpc": "2.0", "id": request_id, "error": {"code": -32601, "message": "no"}}).encode())
        out.write(b"\n")
        out.flush()
