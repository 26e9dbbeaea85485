"""Structured outputs and tool calling through `leanlm serve`'s HTTP API, on real zoo models, with the openai client:
every answer parses and fits its schema (greedy and sampled, streamed and not)."""

import asyncio
import json

import jsonschema
import pytest

from serving import KEY, NAME, Server, openai

from leanlm.models.loading import load
from leanlm.models.zoo import pull

pytestmark = pytest.mark.real_model

# every string and number bounded: a small model may otherwise write one until max_tokens cuts it
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
SCHEMAS = [
    PERSON,
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
     "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}}, "required": ["colour"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                               "minItems": 1, "maxItems": 3}}, "required": ["tags"],
     "additionalProperties": False},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["score"], "additionalProperties": False},
    {"type": "object", "properties": {"count": {"type": "integer", "minimum": 1, "maximum": 9}},
     "required": ["count"], "additionalProperties": False},
    {"type": "object", "properties": {"owner": PERSON, "pets": {"type": "integer", "minimum": 0, "maximum": 20}},
     "required": ["owner", "pets"], "additionalProperties": False},
    {"type": "object", "properties": {"points": {"type": "array", "items": {
        "type": "object", "properties": {"x": {"type": "integer", "minimum": -99, "maximum": 99},
                                         "y": {"type": "integer", "minimum": -99, "maximum": 99}},
        "required": ["x", "y"], "additionalProperties": False}, "minItems": 2, "maxItems": 2}},
     "required": ["points"], "additionalProperties": False},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}},
     "required": ["code"], "additionalProperties": False},
    {"type": "object", "properties": {"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}},
     "required": ["date"]},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "why": {"type": "string", "maxLength": 40}},
     "required": ["answer", "why"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 3, "maxItems": 5},
    {"type": "object", "properties": {"title": {"type": "string", "minLength": 3, "maxLength": 30},
                                      "year": {"type": "integer", "minimum": 1900, "maximum": 2030}},
     "required": ["title", "year"], "additionalProperties": False},
    {"type": "object", "properties": {"level": {"type": "integer", "enum": [1, 2, 3]}, "label": {"const": "fixed"}},
     "required": ["level", "label"], "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"type": "boolean"}}, "required": ["c"], "additionalProperties": False}}, "required": ["b"],
        "additionalProperties": False}}, "required": ["a"], "additionalProperties": False},
    {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 999},
                                                          {"type": "string", "maxLength": 8}]}},
     "required": ["value"], "additionalProperties": False},
    {"type": "object", "properties": {"note": {"type": ["string", "null"], "maxLength": 20}}, "required": ["note"],
     "additionalProperties": False},
    {"type": "object", "properties": {"matrix": {"type": "array", "items": {
        "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 2},
        "minItems": 2, "maxItems": 2}}, "required": ["matrix"], "additionalProperties": False},
    {"type": "object", "properties": {"email": {"type": "string", "format": "email", "maxLength": 40}}, "required": ["email"],
     "additionalProperties": False},
    {"type": "object", "properties": {"price": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000},
                                      "currency": {"enum": ["EUR", "USD"]}, "items": {"type": "array", "items": {
                                          "type": "string", "maxLength": 10}, "maxItems": 2}},
     "required": ["price", "currency", "items"], "additionalProperties": False},
]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a timezone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 30}},
                   "required": ["timezone"], "additionalProperties": False}}}


@pytest.fixture(scope="module", params=["smollm2-135m", "qwen2.5-coder-0.5b"])
def served(request):
    model, tok = load(pull(request.param, progress=False))
    s = Server(model, tok, kv_cache_memory=1 << 28)
    yield request.param, s
    s.stop()


async def ask_all(url: str, requests: list[dict]) -> list[str]:
    """Each request's answer text, all sent at once (the engine batches them)."""
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0) as c:
        async def one(kw):
            if not kw.get("stream"):
                return (await c.chat.completions.create(**kw)).choices[0].message.content
            text = ""
            async for chunk in await c.chat.completions.create(**kw):
                text += "".join(ch.delta.content or "" for ch in chunk.choices)
            return text

        return await asyncio.gather(*(one(kw) for kw in requests))


def test_json_schemas_always_parse_and_validate(served):
    name, server = served
    requests, schemas = [], []
    for i, schema in enumerate(SCHEMAS):
        for greedy, stream in ((True, False), (False, True), (True, True), (False, False)):
            requests.append(dict(
                model=NAME, max_tokens=200, stream=stream, temperature=0 if greedy else 1.0, seed=i,
                messages=[{"role": "user", "content": f"Write a JSON value that fits this schema: {json.dumps(schema)}"}],
                response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema,
                                                                        "strict": True}}))
            schemas.append(schema)
    answers = asyncio.run(ask_all(server.url, requests))
    misses = []
    for schema, answer in zip(schemas, answers):
        try:
            jsonschema.validate(json.loads(answer), schema)
        except (ValueError, jsonschema.ValidationError) as e:
            misses.append(f"{json.dumps(schema)[:80]} -> {answer[:120]!r}: {str(e)[:80]}")
    assert not misses, f"{len(misses)} of {len(answers)} answers missed their schema:\n" + "\n".join(misses)


def test_json_object_regex_and_choice(served):
    _, server = served
    c = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    ask = [{"role": "user", "content": "A JSON object with a cat's name and age, nothing else."}]
    obj = c.chat.completions.create(model=NAME, messages=ask, max_tokens=400, temperature=0,
                                    response_format={"type": "json_object"})
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    date = c.completions.create(model=NAME, prompt="Today's date is ", max_tokens=20, temperature=0.8, seed=1,
                                extra_body={"structured_outputs": {"regex": "20[0-9]{2}-[01][0-9]-[0-3][0-9]"}})
    assert __import__("re").fullmatch("20[0-9]{2}-[01][0-9]-[0-3][0-9]", date.choices[0].text)
    picks = c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Pick a colour."}],
                                      max_tokens=10, n=4, temperature=1.0, extra_body={"guided_choice": ["red", "blue"]})
    assert {ch.message.content for ch in picks.choices} <= {"red", "blue"}


def test_named_and_required_tool_choices_return_arguments_that_fit(served):
    _, server = served
    c = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    ask = [{"role": "user", "content": "What is the weather in Paris, and the time in Tokyo?"}]
    named = c.chat.completions.create(model=NAME, messages=ask, tools=[WEATHER, TIME], max_tokens=100, temperature=0,
                                      tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = named.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and named.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    required = c.chat.completions.create(model=NAME, messages=ask, tools=[WEATHER, TIME], max_tokens=200,
                                         tool_choice="required", temperature=0.7, seed=3)
    calls = required.choices[0].message.tool_calls
    assert calls and all(x.function.name in ("get_weather", "get_time") for x in calls)
    tools = {"get_weather": WEATHER, "get_time": TIME}
    for x in calls:
        jsonschema.validate(json.loads(x.function.arguments), tools[x.function.name]["function"]["parameters"])
    # streamed: the same call arrives as tool-call deltas
    name, args = "", ""
    for chunk in c.chat.completions.create(model=NAME, messages=ask, tools=[WEATHER, TIME], max_tokens=100,
                                           stream=True, temperature=0, tool_choice={"type": "function", "function": {"name": "get_weather"}}):
        for ch in chunk.choices:
            for d in ch.delta.tool_calls or []:
                name += d.function.name or ""
                args += d.function.arguments or ""
    assert name == "get_weather" and json.loads(args) == json.loads(call.function.arguments)


def test_a_two_turn_tool_loop_with_the_openai_client(served):
    """Call, tool result fed back through the template, final answer."""
    model_name, server = served
    c = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    messages = [{"role": "user", "content": "What's the weather in Paris? Use the tool."}]
    first = c.chat.completions.create(model=NAME, messages=messages, tools=[WEATHER], tool_choice="required",
                                      max_tokens=100, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 21, "sky": "clear"})}]
    final = c.chat.completions.create(model=NAME, messages=messages, tools=[WEATHER], max_tokens=60, temperature=0)
    assert final.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert final.choices[0].message.content or final.choices[0].message.tool_calls
    if model_name.startswith("qwen"):  # its template carries the result back to the model as <tool_response>
        assert "21" in final.choices[0].message.content or final.choices[0].message.tool_calls


def test_langchain_structured_output_and_tool_binding(served):
    """LangChain's ChatOpenAI pointed at the server: with_structured_output(method="json_schema") returns the
    object, and bind_tools(tool_choice=...) returns a tool call with arguments that fit."""
    langchain_openai = pytest.importorskip("langchain_openai")
    _, server = served
    llm = langchain_openai.ChatOpenAI(model=NAME, base_url=server.url + "/v1", api_key=KEY, temperature=0,
                                      max_tokens=120, max_retries=0)
    person = llm.with_structured_output(PERSON | {"title": "Person"}, method="json_schema", strict=True)
    answer = person.invoke("Invent a person with a name and an age.")
    jsonschema.validate(answer, PERSON)
    message = llm.bind_tools([WEATHER], tool_choice="get_weather").invoke("Weather in Oslo, in celsius?")
    assert message.tool_calls[0]["name"] == "get_weather"
    jsonschema.validate(message.tool_calls[0]["args"], WEATHER["function"]["parameters"])
