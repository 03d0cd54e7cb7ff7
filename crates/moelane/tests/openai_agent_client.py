"""Agent traffic with the real `openai` Python client against a moelane gateway serving one
family's checkpoint with that family's own chat template (so its own tool-call markup).
Usage: python3 openai_agent_client.py http://127.0.0.1:PORT/v1 LABEL [KWARGS_JSON]
KWARGS_JSON: chat_template_kwargs that make the template open a thinking block in the prompt
(the answer is then reasoning_content until the block closes); "" where the template has none.

The weights are random: the constrained answers (forced calls, json_schema) must parse and
validate; the free ones (auto, none) must only answer."""
import json
import sys

from openai import OpenAI

base, label = sys.argv[1], sys.argv[2]
think_kwargs = json.loads(sys.argv[3]) if len(sys.argv) > 3 and sys.argv[3] else None
c = OpenAI(base_url=base, api_key="none")
model = c.models.list().data[0].id

tools = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
     "parameters": {"type": "object", "properties": {
         "city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]},
         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
         "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "description": "Adds two digits",
     "parameters": {"type": "object", "properties": {
         "a": {"type": "integer", "minimum": 0, "maximum": 9},
         "b": {"type": "integer", "minimum": 0, "maximum": 9}},
         "required": ["a", "b"], "additionalProperties": False}}},
]
ask = [{"role": "user", "content": "What is the weather in Oslo, and what is 2 + 3?"}]


def valid(call):
    """A call's arguments checked against its tool's schema; its name."""
    assert call.type == "function" and call.id.startswith("call_"), call
    args = json.loads(call.function.arguments)
    name = call.function.name
    if name == "get_weather":
        assert set(args) <= {"city", "unit", "days"} and {"city", "unit"} <= set(args), args
        assert isinstance(args["city"], str) and len(args["city"]) <= 12, args
        assert args["unit"] in ("c", "f"), args
        assert "days" not in args or (type(args["days"]) is int and 1 <= args["days"] <= 7), args
    elif name == "add":
        assert set(args) == {"a", "b"}, args
        assert all(type(args[k]) is int and 0 <= args[k] <= 9 for k in "ab"), args
    else:
        raise AssertionError(f"unknown function {name}")
    return name


# a single forced call
r = c.chat.completions.create(model=model, messages=ask, tools=tools, tool_choice="required",
                              parallel_tool_calls=False, max_tokens=400, temperature=0)
ch = r.choices[0]
assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1, r
single = ch.message.tool_calls[0]
valid(single)
print(label, "single call ok:", single.function.name, single.function.arguments)

# parallel: one call or more, sampled, each valid
counts = []
for seed in range(3):
    r = c.chat.completions.create(model=model, messages=ask, tools=tools, tool_choice="required",
                                  max_tokens=800, temperature=1.0, seed=seed)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and 1 <= len(ch.message.tool_calls) <= 8, r
    for call in ch.message.tool_calls:
        valid(call)
    counts.append(len(ch.message.tool_calls))
print(label, "parallel calls ok:", counts)

# a named function, whole and streamed: the same call, deltas with their index
named = {"type": "function", "function": {"name": "add"}}
r = c.chat.completions.create(model=model, messages=ask, tools=tools, tool_choice=named,
                              max_tokens=400, temperature=0)
calls = r.choices[0].message.tool_calls
assert len(calls) == 1 and valid(calls[0]) == "add", r
parts, finish, pieces = {}, None, 0
for chunk in c.chat.completions.create(model=model, messages=ask, tools=tools, tool_choice=named,
                                       max_tokens=400, temperature=0, stream=True):
    for choice in chunk.choices:
        finish = choice.finish_reason or finish
        for d in choice.delta.tool_calls or []:
            p = parts.setdefault(d.index, {"name": "", "arguments": ""})
            p["name"] += d.function.name or ""
            p["arguments"] += d.function.arguments or ""
            pieces += bool(d.function.arguments)
assert parts == {0: {"name": "add", "arguments": calls[0].function.arguments}}, (parts, calls)
assert finish == "tool_calls", finish
# the arguments arrive as they are written, not whole at the end
assert pieces > 2, pieces
# the SDK's stream helper (strict tools only): its argument delta events, and the call
# parsed at the end, the same as the whole answer's
strict = [{"type": "function", "function": dict(t["function"], strict=True)} for t in tools]
weather = {"type": "function", "function": {"name": "get_weather"}}
whole = c.chat.completions.create(model=model, messages=ask, tools=strict, tool_choice=weather,
                                  max_tokens=400, temperature=0).choices[0].message.tool_calls[0]
with c.chat.completions.stream(model=model, messages=ask, tools=strict, tool_choice=weather,
                               max_tokens=400, temperature=0) as s:
    deltas = [e for e in s if e.type == "tool_calls.function.arguments.delta"]
    done = s.get_final_completion()
assert len(deltas) > 2 and "".join(d.arguments_delta for d in deltas) == whole.function.arguments, deltas
got = done.choices[0].message.tool_calls[0]
assert got.function.parsed_arguments == json.loads(whole.function.arguments), (got, whole)
valid(got)
print(label, "named and streamed ok")

# none and auto: free text answers (random weights: whatever they write)
r = c.chat.completions.create(model=model, messages=ask, tools=tools, tool_choice="none",
                              max_tokens=16, temperature=0)
assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason != "tool_calls", r
r = c.chat.completions.create(model=model, messages=ask, tools=tools, max_tokens=16, temperature=0)
assert r.choices[0].finish_reason in ("length", "stop", "tool_calls"), r
for call in r.choices[0].message.tool_calls or []:
    json.loads(call.function.arguments)
print(label, "none and auto ok")

# the result goes back in (the family's template renders the call and its result)
r = c.chat.completions.create(model=model, tools=tools, max_tokens=8, temperature=0, messages=ask + [
    {"role": "assistant", "content": None, "tool_calls": [{"id": single.id, "type": "function",
     "function": {"name": single.function.name, "arguments": single.function.arguments}}]},
    {"role": "tool", "tool_call_id": single.id, "content": "-3C, snow"}])
assert r.choices[0].message.role == "assistant" and r.usage.prompt_tokens > 20, r
print(label, "round trip ok")

# reasoning: where the template opens the thinking block, the answer is reasoning_content
if think_kwargs is not None:
    r = c.chat.completions.create(model=model, messages=ask, max_tokens=12, temperature=0,
                                  extra_body={"chat_template_kwargs": think_kwargs})
    m = r.choices[0].message
    reasoning = (m.model_extra or {}).get("reasoning_content")
    assert isinstance(reasoning, str) and reasoning, r
    text = reasoning
    streamed = {"reasoning_content": "", "content": ""}
    for chunk in c.chat.completions.create(model=model, messages=ask, max_tokens=12, temperature=0,
                                           stream=True, extra_body={"chat_template_kwargs": think_kwargs}):
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            streamed["reasoning_content"] += extra.get("reasoning_content") or ""
            streamed["content"] += choice.delta.content or ""
    assert streamed["reasoning_content"] == text and streamed["content"] == (m.content or ""), (streamed, r)
    print(label, "reasoning_content ok")

# json_schema strict: the random weights answer valid JSON
schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
          "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
for seed in range(2):
    r = c.chat.completions.create(model=model, messages=ask, max_tokens=200, temperature=1.0, seed=seed,
                                  response_format={"type": "json_schema",
                                                   "json_schema": {"name": "person", "schema": schema, "strict": True}})
    assert r.choices[0].finish_reason == "stop", r
    obj = json.loads(r.choices[0].message.content)
    assert set(obj) == {"name", "age"} and type(obj["age"]) is int and 0 <= obj["age"] <= 120, obj
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 16, obj
print(label, "json_schema ok")
print("ALL OK")
