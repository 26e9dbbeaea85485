"""OpenAI tool calling for chat completions, as vLLM does it for Qwen2.5 (`--tool-call-parser hermes`).

tool_choice "auto": the model writes Hermes blocks, `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`
(or the whole answer is such a JSON object, or a list of them), which `parse_tool_calls` / `ToolCallStream` turn
into `tool_calls`. tool_choice "required" or a named function: decoding is constrained to `forced_schema`, and
`forced_calls` reads the result. tool_choice "none": the tools are still rendered into the prompt (as vLLM does),
the output is just not parsed.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Collection

from leanlm.errors import LeanLMError

START, END = "<tool_call>", "</tool_call>"
_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_BLOCK = re.compile(re.escape(START) + r"(.*?)(?:" + re.escape(END) + r"|\Z)", re.S)
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def validate_tools(tools: list[dict] | None) -> list[dict]:
    """Check a request's `tools`; return them with `parameters` defaulted to an empty object schema."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise LeanLMError("`tools` must be a list of {\"type\": \"function\", \"function\": {...}}")
    out, seen = [], set()
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise LeanLMError(f"tools[{i}]: only {{\"type\": \"function\", \"function\": {{...}}}} tools are supported")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise LeanLMError(f"tools[{i}]: function name {name!r} must match ^[a-zA-Z0-9_-]{{1,64}}$")
        if name in seen:
            raise LeanLMError(f"tools[{i}]: function {name!r} is defined twice; function names must be unique")
        seen.add(name)
        params = fn.get("parameters")
        if params is None:
            params = dict(_EMPTY_PARAMETERS)
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise LeanLMError(f"tools[{i}] ({name}): `parameters` must be a JSON schema of an object")
        out.append({"type": "function", "function": {**fn, "parameters": params}})
    return out


def template_messages(messages: list[dict]) -> list[dict]:
    """OpenAI chat messages -> the dicts an HF chat template reads: content None -> "", text parts joined, each
    assistant tool call's `arguments` JSON string parsed into a dict (templates write `arguments | tojson`)."""
    out = []
    for i, m in enumerate(messages):
        m = dict(m)
        content = m.get("content")
        if content is None:
            m["content"] = ""
        elif isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            m["content"] = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        if m.get("tool_calls"):
            m["tool_calls"] = [_template_call(call, i) for call in m["tool_calls"]]
        else:
            m.pop("tool_calls", None)
        out.append(m)
    return out


def _template_call(call: dict, i: int) -> dict:
    fn = call.get("function", call)
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise LeanLMError(f"messages[{i}]: tool call {fn.get('name')!r} has arguments that are not valid "
                              f"JSON: {args!r}") from None
    return {**call, "type": "function", "function": {"name": fn.get("name"), "arguments": args or {}}}


def _call(name: str, arguments: dict | list) -> dict:
    return {"id": "call_" + secrets.token_hex(12), "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _hermes_call(body: str, names: Collection[str]) -> dict | None:
    """The call in one <tool_call> block's text, or None when it is not JSON naming one of the tools."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return _call(obj["name"], args) if isinstance(args, dict) else None


def _json_calls(text: str, names: Collection[str]) -> list[dict] | None:
    """The calls when the whole text is {"name", "arguments"|"parameters"} or a non-empty list of them, else None."""
    if not text.strip().startswith(("{", "[")):
        return None
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    items = obj if isinstance(obj, list) else [obj]
    if not items or not all(isinstance(x, dict) and set(x) <= {"name", "arguments", "parameters"} for x in items):
        return None
    calls = [_hermes_call(json.dumps(x), names) for x in items]
    return None if None in calls else calls


def parse_tool_calls(text: str, tool_names: Collection[str]) -> tuple[str | None, list[dict]]:
    """A finished output (tool_choice "auto") -> (content, tool_calls).

    Each <tool_call> block whose JSON names one of `tool_names` becomes a call; a block that does not parse, or
    names another function, stays in the content as written (vLLM's behaviour), as does an unclosed block at the
    end (a length cut) that does not parse. Without calls the content is the text unchanged; with calls it is the
    text outside them without trailing whitespace, None when nothing is left."""
    calls = _json_calls(text, tool_names)
    if calls is not None:
        return None, calls
    content, calls, pos = [], [], 0
    for match in _BLOCK.finditer(text):
        content.append(text[pos:match.start()])
        pos = match.end()
        call = _hermes_call(match.group(1), tool_names)
        if call is None:
            content.append(match.group(0))
        else:
            calls.append(call)
    content.append(text[pos:])
    if not calls:
        return text, []
    return "".join(content).rstrip() or None, calls


class ToolCallStream:
    """`parse_tool_calls` for streaming: text deltas in, OpenAI chat-completion-chunk `delta` dicts out.

    Text that may still become a "<tool_call>" is held back, as is trailing whitespace (dropped at the end when
    there were calls) and an answer that starts like a JSON call, until its JSON value is complete. A call's
    deltas come when its block closes: one with id, name and "" arguments, then one with the arguments."""

    def __init__(self, tool_names: Collection[str]):
        self.names = tool_names
        self._buf = ""          # text not yet handled
        self._in_block = False  # _buf is the inside of an open <tool_call> block
        self._json = True       # nothing seen but whitespace, or a JSON value that may be the whole answer
        self._json_done = False  # that JSON value is complete
        self._ws = ""           # trailing whitespace of the content, held
        self._count = 0         # calls emitted

    def feed(self, text: str) -> list[dict]:
        self._buf += text
        if self._json and not self._still_json(text):
            self._json = False
        return [] if self._json else self._drain(final=False)

    def finish(self) -> list[dict]:
        if self._json:
            calls = _json_calls(self._buf, self.names)
            if calls is not None:
                return [d for call in calls for d in self._call_deltas(call)]
            self._json = False
        out = self._drain(final=True)
        if self._ws and not self._count:
            out.append({"content": self._ws})
        return out

    def _still_json(self, delta: str) -> bool:
        """Whether the text so far may still be a whole-answer JSON call (and so must be held)."""
        head = self._buf.lstrip()
        if not head:
            return True
        if head[0] not in "{[":
            return False
        if not self._json_done and "}" not in delta and "]" not in delta:
            return True  # a JSON value can only have been completed by a closing bracket
        try:
            _, end = json.JSONDecoder().raw_decode(head)
        except ValueError:
            return True  # incomplete, or invalid: known only at the end
        self._json_done = True
        return not head[end:].strip() and _json_calls(head[:end], self.names) is not None

    def _drain(self, final: bool) -> list[dict]:
        out = []
        while True:
            if self._in_block:
                j = self._buf.find(END)
                if j < 0 and not final:
                    return out
                body, self._buf = (self._buf, "") if j < 0 else (self._buf[:j], self._buf[j + len(END):])
                self._in_block = False
                call = _hermes_call(body, self.names)
                if call is None:
                    out += self._content(START + body + (END if j >= 0 else ""))
                else:
                    out += self._call_deltas(call)
            else:
                i = self._buf.find(START)
                if i < 0:
                    keep = 0 if final else _partial_tag(self._buf)
                    text, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
                    return out + self._content(text)
                out += self._content(self._buf[:i])
                self._buf, self._in_block = self._buf[i + len(START):], True

    def _content(self, text: str) -> list[dict]:
        text = self._ws + text
        body = text.rstrip()
        self._ws = text[len(body):]
        return [{"content": body}] if body else []

    def _call_deltas(self, call: dict) -> list[dict]:
        self._count += 1
        return call_deltas(self._count - 1, call)


def call_deltas(i: int, call: dict) -> list[dict]:
    """A call as OpenAI streams it: one delta with id, name and "" arguments, then one with the arguments."""
    fn = call["function"]
    return [{"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                             "function": {"name": fn["name"], "arguments": ""}}]},
            {"tool_calls": [{"index": i, "function": {"arguments": fn["arguments"]}}]}]


def _partial_tag(text: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of "<tool_call>"."""
    for n in range(min(len(text), len(START) - 1), 0, -1):
        if START.startswith(text[-n:]):
            return n
    return 0


def forced_schema(tools: list[dict], tool_choice: str | dict | None, parallel: bool = True) -> dict | None:
    """The JSON schema the output must follow for a forced tool_choice, or None for "auto"/"none" (None too).

    A named function {"type": "function", "function": {"name": X}}: X's parameters (the output is the arguments).
    "required": a list of 1 (up to any number when `parallel`) {"name", "parameters"} objects, one of the tools
    each; `$defs` of the tools move to the top so that their "#/$defs/..." references still resolve."""
    if tool_choice in (None, "auto", "none"):
        return None
    if tool_choice == "required":
        if not tools:
            raise LeanLMError("tool_choice \"required\" needs a non-empty `tools` list")
        defs, items = {}, []
        for tool in tools:
            fn = tool["function"]
            params = dict(fn.get("parameters") or _EMPTY_PARAMETERS)
            for key, schema in params.pop("$defs", {}).items():
                if defs.setdefault(key, schema) != schema:
                    raise LeanLMError(f"tools: two functions define a different $defs/{key}; rename one")
            items.append({"type": "object", "properties": {"name": {"type": "string", "enum": [fn["name"]]},
                                                           "parameters": params},
                          "required": ["name", "parameters"], "additionalProperties": False})
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not parallel:
            schema["maxItems"] = 1
        return {**schema, "$defs": defs} if defs else schema
    return dict(_named_tool(tools, tool_choice).get("parameters") or _EMPTY_PARAMETERS)


def _named_tool(tools: list[dict], tool_choice) -> dict:
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not isinstance(fn, dict) or tool_choice.get("type") != "function":
        raise LeanLMError(f"tool_choice {tool_choice!r}: use \"none\", \"auto\", \"required\" or "
                          "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    for tool in tools or []:
        if tool["function"]["name"] == fn.get("name"):
            return tool["function"]
    known = ", ".join(t["function"]["name"] for t in tools or []) or "none"
    raise LeanLMError(f"tool_choice names function {fn.get('name')!r}, which is not in `tools` (they are: {known})")


def forced_calls(text: str, tools: list[dict], tool_choice: str | dict) -> list[dict]:
    """The tool_calls of an output constrained by `forced_schema`; [] when the text is not complete JSON of the
    expected shape (a length cut): the caller then answers with the raw text as content, finish_reason "length"."""
    try:
        obj = json.loads(text)
    except ValueError:
        return []
    if tool_choice == "required":
        names = {t["function"]["name"] for t in tools}
        ok = isinstance(obj, list) and obj and all(
            isinstance(x, dict) and x.get("name") in names and isinstance(x.get("parameters"), dict) for x in obj)
        return [_call(x["name"], x["parameters"]) for x in obj] if ok else []
    if tool_choice in (None, "auto", "none"):
        raise ValueError(f"forced_calls: tool_choice {tool_choice!r} is not forced")
    name = _named_tool(tools, tool_choice)["name"]
    return [_call(name, obj)] if isinstance(obj, dict) else []


class ChatOutput:
    """How a chat choice's text becomes the answer: plain content (no tools, or tool_choice "none"), Hermes or
    JSON tool calls parsed out of it ("auto"), or the calls a forced choice's grammar made it write."""

    def __init__(self, tools: list[dict], tool_choice: str | dict):
        self.tools, self.choice = tools, tool_choice
        self.names = [t["function"]["name"] for t in tools]

    @property
    def parses(self) -> bool:
        return bool(self.tools) and self.choice != "none"

    def message(self, text: str) -> tuple[dict, bool]:
        """(the assistant message, whether it holds tool calls)."""
        if not self.parses:
            return {"role": "assistant", "content": text}, False
        if self.choice == "auto":
            content, calls = parse_tool_calls(text, self.names)
        else:
            calls = forced_calls(text, self.tools, self.choice)
            content = None if calls else text
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        return message, bool(calls)

    def stream(self):
        """An object with feed(text) and finish() -> chunk `delta` dicts."""
        if not self.parses:
            return _PlainStream()
        return ToolCallStream(self.names) if self.choice == "auto" else _ForcedStream(self)


class _PlainStream:
    def feed(self, text: str) -> list[dict]:
        return [{"content": text}] if text else []

    def finish(self) -> list[dict]:
        return []


class _ForcedStream:
    """A forced call's JSON, held until it is whole, then streamed as its tool-call deltas (as content if a length
    cut left it unparsable)."""

    def __init__(self, output: ChatOutput):
        self.output, self.text = output, ""

    def feed(self, text: str) -> list[dict]:
        self.text += text
        return []

    def finish(self) -> list[dict]:
        message, _ = self.output.message(self.text)
        if message["content"] is not None:
            return [{"content": message["content"]}]
        return [d for i, call in enumerate(message["tool_calls"]) for d in call_deltas(i, call)]
