"""Tool calling's pure parts: rendering tools into prompts, parsing calls (whole and streamed), forced tool_choice."""

import json
import random

import pytest

from leanlm.errors import LeanLMError
from leanlm.serve.tools import (ToolCallStream, forced_calls, forced_schema, parse_tool_calls, template_messages,
                                validate_tools)
from leanlm.tokenizer import Tokenizer
from tests.conftest import make_tokenizer


def tool(name, **properties):
    return {"type": "function", "function": {"name": name, "description": f"the {name} function",
                                             "parameters": {"type": "object", "properties": properties,
                                                            "required": sorted(properties)}}}


TOOLS = validate_tools([tool("get_weather", city={"type": "string"}, unit={"enum": ["c", "f"]}),
                        tool("get_time", tz={"type": "string"})])
NAMES = {"get_weather", "get_time"}
CONVERSATION = [  # OpenAI messages: a question, the model's call, its result
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
]
CALL_BLOCK = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
RESPONSE_BLOCK = '<tool_response>\n{"temp": 21}\n</tool_response>'


# --- rendering -------------------------------------------------------------------------------------------------------

@pytest.mark.real_model
def test_qwen_template_renders_tools_calls_and_results_as_transformers_does():
    from transformers import AutoTokenizer

    from leanlm.models.zoo import pull

    path = pull("qwen2.5-coder-0.5b", progress=False)
    ours = Tokenizer(path)
    messages = template_messages(CONVERSATION)
    text = ours.apply_chat_template(messages, tools=TOOLS)
    for piece in ("# Tools", "<tools>", '"name": "get_weather"', '"name": "get_time"', "<tool_call></tool_call>",
                  "Be brief.", CALL_BLOCK, "<|im_start|>user\n" + RESPONSE_BLOCK + "<|im_end|>"):
        assert piece in text
    assert text.endswith("<|im_start|>assistant\n")
    theirs = AutoTokenizer.from_pretrained(path)
    assert text == theirs.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    plain = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(plain, tools=None) == ours.apply_chat_template(plain)
    assert "# Tools" not in ours.apply_chat_template(plain, tools=[])


@pytest.fixture(scope="module")
def tiny_tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    make_tokenizer(path)
    return Tokenizer(path)


def test_fallback_rendering_for_a_template_without_tools(tiny_tok):
    text = tiny_tok.apply_chat_template(template_messages(CONVERSATION), tools=TOOLS)
    system = text[:text.index("</s>")]
    assert system.startswith("<s>system: # Tools") and system.endswith("\n\nBe brief.")  # merged, tools first
    assert json.dumps(TOOLS[0]) in system and json.dumps(TOOLS[1]) in system
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in system
    assert f"<s>assistant: {CALL_BLOCK}</s>" in text  # the earlier call, written as the model is told to write
    assert f"<s>user: {RESPONSE_BLOCK}</s>" in text
    # No system message: a new first one. No tools: the template as before.
    text = tiny_tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=TOOLS)
    assert text.startswith("<s>system: # Tools") and text.endswith("</s><s>user: hi</s><s>assistant:")
    assert tiny_tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<s>user: hi</s><s>assistant:"
    # Parallel results merge into one user turn; string arguments render as they are.
    turns = [{"role": "assistant", "content": "Both.", "tool_calls": [
                 {"function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}},
                 {"function": {"name": "get_time", "arguments": {"tz": "CET"}}}]},
             {"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}]
    text = tiny_tok.apply_chat_template(turns, add_generation_prompt=False)
    assert text == ('<s>assistant: Both.\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
                    '\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call></s>'
                    "<s>user: <tool_response>\n1\n</tool_response>\n<tool_response>\n2\n</tool_response></s>")


def test_template_messages():
    out = template_messages(CONVERSATION)
    assert out[2]["content"] == "" and out[2]["tool_calls"][0]["function"] == {
        "name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}
    assert out[3] == CONVERSATION[3] and CONVERSATION[2]["content"] is None  # input untouched
    assert template_messages(out) == out
    assert template_messages([{"role": "user", "content": [{"type": "text", "text": "a"},
                                                           {"type": "text", "text": "b"}]}])[0]["content"] == "ab"
    bad = [CONVERSATION[1], {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]
    with pytest.raises(LeanLMError, match=r"messages\[1\].*'f'.*not valid JSON"):
        template_messages(bad)


@pytest.mark.parametrize("tools, match", [
    ("get_weather", "must be a list"),
    ([{"type": "retrieval"}], r"tools\[0\]: only"),
    ([{"type": "function", "function": {"name": "has space"}}], "must match"),
    ([{"type": "function", "function": {"name": "x" * 65}}], "must match"),
    ([{"type": "function", "function": {}}], "must match"),
    ([tool("f"), tool("g"), tool("f")], r"tools\[2\]: function 'f' is defined twice"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}], "object"),
    ([{"type": "function", "function": {"name": "f", "parameters": "{}"}}], "object"),
])
def test_bad_tools_are_refused(tools, match):
    with pytest.raises(LeanLMError, match=match):
        validate_tools(tools)


def test_validate_tools_defaults_parameters():
    assert validate_tools(None) == []
    out = validate_tools([{"type": "function", "function": {"name": "now"}}])
    empty = {"type": "object", "properties": {}}
    assert out == [{"type": "function", "function": {"name": "now", "parameters": empty}}]


# --- parsing (tool_choice "auto") ------------------------------------------------------------------------------------

W = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
T = '{"name": "get_time", "arguments": {"tz": "CET"}}'
CASES = [  # text, content, [(name, arguments)]
    (f"<tool_call>\n{W}\n</tool_call>", None, [("get_weather", {"city": "Paris"})]),
    (f"<tool_call>\n{W}\n</tool_call>\n<tool_call>\n{T}\n</tool_call>", None,
     [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]),
    (f"Let me look.\n\n<tool_call>\n{W}\n</tool_call>", "Let me look.", [("get_weather", {"city": "Paris"})]),
    (f"  \n<tool_call>{W}</tool_call>\n", None, [("get_weather", {"city": "Paris"})]),
    ('<tool_call>\n{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}\n</tool_call>', None,
     [("get_time", {"tz": "UTC"})]),
    ('<tool_call>\n{"name": "get_time", "parameters": {}}\n</tool_call>', None, [("get_time", {})]),
    ("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \n</tool_call>",
     "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \n</tool_call>", []),
    ('<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',
     '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>', []),
    (f'A <tool_call>{{"name": "rm_rf"}}</tool_call> B <tool_call>{T}</tool_call> C\n',
     'A <tool_call>{"name": "rm_rf"}</tool_call> B  C', [("get_time", {"tz": "CET"})]),
    (W, None, [("get_weather", {"city": "Paris"})]),
    (f"\n[{W}, {T}]\n", None, [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]),
    ('{"name": "get_time", "parameters": {"tz": "UTC"}}', None, [("get_time", {"tz": "UTC"})]),
    ('{"name": "rm_rf", "arguments": {}}', '{"name": "rm_rf", "arguments": {}}', []),
    ('{"name": "get_time", "arguments": {}, "why": 1}', '{"name": "get_time", "arguments": {}, "why": 1}', []),
    (f"{W} and more", f"{W} and more", []),
    ("[]", "[]", []),
    ('{"answer": 42}', '{"answer": 42}', []),
    (f"<tool_call>\n{W}", None, [("get_weather", {"city": "Paris"})]),  # unclosed, but complete JSON
    (f"Sure <tool_call>\n{W[:-9]}", f"Sure <tool_call>\n{W[:-9]}", []),  # cut mid-JSON
    ("Plain answer, no tools.\n", "Plain answer, no tools.\n", []),
    ("a < b and <tool_ is not a tag <tool_call", "a < b and <tool_ is not a tag <tool_call", []),
    ("", "", []),
    (" \n", " \n", []),
]


def simple(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("text, content, calls", CASES)
def test_parse_tool_calls(text, content, calls):
    got_content, got = parse_tool_calls(text, NAMES)
    assert got_content == content and simple(got) == calls
    for c in got:
        assert c["type"] == "function" and c["id"].startswith("call_") and len(c["id"]) == 29
        int(c["id"][5:], 16)
    assert len({c["id"] for c in got}) == len(got)


def stream(chunks):
    """Feed the chunks to a ToolCallStream; return (content, calls) reassembled as an OpenAI client does."""
    s, deltas = ToolCallStream(NAMES), []
    for chunk in chunks:
        deltas += s.feed(chunk)
    deltas += s.finish()
    content, calls = "", []
    for d in deltas:
        assert len(d) == 1 and (d.get("content") or d.get("tool_calls"))
        content += d.get("content", "")
        for tc in d.get("tool_calls", []):
            if tc["index"] == len(calls):
                assert tc["id"].startswith("call_") and tc["type"] == "function"
                calls.append({"name": tc["function"]["name"], "arguments": tc["function"]["arguments"]})
            else:
                calls[tc["index"]]["arguments"] += tc["function"]["arguments"]
    return content, [(c["name"], json.loads(c["arguments"])) for c in calls]


@pytest.mark.parametrize("text, content, calls", CASES)
def test_stream_equals_whole_parse_in_every_split(text, content, calls):
    expected = (content or "", calls)
    assert stream([text]) == expected
    assert stream(list(text)) == expected
    rng = random.Random(0)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 6)))) if len(text) > 1 else []
        assert stream([text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]) == expected


def test_stream_does_not_hold_plain_text():
    s = ToolCallStream(NAMES)
    assert s.feed("Hello") == [{"content": "Hello"}]
    assert s.feed(" world <tool") == [{"content": " world"}]  # " <tool" may still become a tag
    assert s.feed("kit>") == [{"content": " <toolkit>"}]
    assert s.feed("<tool_call>" + W) == []
    assert [d["tool_calls"][0]["index"] for d in s.feed("</tool_call>")] == [0, 0]
    assert s.finish() == []


# --- forced tool_choice ----------------------------------------------------------------------------------------------

def check(schema, instance) -> bool:
    jsonschema = pytest.importorskip("jsonschema")
    try:
        jsonschema.validate(instance, schema)
    except jsonschema.ValidationError:
        return False
    return True


def test_forced_schema_named():
    choice = {"type": "function", "function": {"name": "get_weather"}}
    schema = forced_schema(TOOLS, choice)
    assert schema == TOOLS[0]["function"]["parameters"]
    assert check(schema, {"city": "Paris", "unit": "c"}) and not check(schema, {"city": "Paris", "unit": "k"})
    calls = forced_calls('{"city" :"Paris",\n "unit": "c"}', TOOLS, choice)
    assert simple(calls) == [("get_weather", {"city": "Paris", "unit": "c"})]
    assert calls[0]["function"]["arguments"] == '{"city": "Paris", "unit": "c"}'
    assert forced_calls('{"city": "Par', TOOLS, choice) == []  # a length cut: the caller reports the raw text
    with pytest.raises(LeanLMError, match="'nope', which is not in `tools`.*get_weather, get_time"):
        forced_schema(TOOLS, {"type": "function", "function": {"name": "nope"}})
    with pytest.raises(LeanLMError, match="tool_choice"):
        forced_schema(TOOLS, "sometimes")


@pytest.mark.parametrize("parallel", [False, True])
def test_forced_schema_required(parallel):
    schema = forced_schema(TOOLS, "required", parallel=parallel)
    one = [{"name": "get_time", "parameters": {"tz": "CET"}}]
    two = [*one, {"name": "get_weather", "parameters": {"city": "Oslo", "unit": "f"}}]
    assert check(schema, one) and check(schema, two) == parallel
    for bad in ([], [{"name": "get_time"}], [{"name": "get_time", "parameters": {}}],
                [{"name": "rm_rf", "parameters": {}}], [{"name": "get_time", "parameters": {"tz": "CET"}, "x": 1}],
                [{"name": "get_time", "parameters": {"city": "Oslo", "unit": "f"}}]):
        assert not check(schema, bad), bad
    assert simple(forced_calls(json.dumps(two), TOOLS, "required")) == [
        ("get_time", {"tz": "CET"}), ("get_weather", {"city": "Oslo", "unit": "f"})]
    assert forced_calls(json.dumps(two)[:-5], TOOLS, "required") == []


def test_forced_schema_none_auto_and_defs():
    assert forced_schema(TOOLS, "auto") is None and forced_schema(TOOLS, "none") is None
    assert forced_schema([], None) is None
    with pytest.raises(LeanLMError, match="required"):
        forced_schema([], "required")
    point = {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}
    tools = validate_tools([{"type": "function", "function": {"name": "move", "parameters": {
        "type": "object", "properties": {"to": {"$ref": "#/$defs/point"}}, "required": ["to"],
        "$defs": {"point": point}}}}])
    schema = forced_schema(tools, "required")
    assert schema["$defs"] == {"point": point}
    assert check(schema, [{"name": "move", "parameters": {"to": {"x": 1}}}])
    assert not check(schema, [{"name": "move", "parameters": {"to": {"y": 1}}}])
