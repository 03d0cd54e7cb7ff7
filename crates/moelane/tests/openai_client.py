"""Drives a running moelane gateway with the real `openai` Python client.
Usage: python3 openai_client.py http://127.0.0.1:PORT/v1"""
import asyncio
import sys

import openai
from openai import AsyncOpenAI, OpenAI

base = sys.argv[1]
c = OpenAI(base_url=base, api_key="none")
model = c.models.list().data[0].id
assert model == "tiny", model
# models.retrieve: the served model, and a 404 for another
m = c.models.retrieve(model)
assert m.id == model and m.object == "model", m
try:
    c.models.retrieve("no-such-model")
    raise SystemExit("expected NotFoundError")
except openai.NotFoundError as e:
    assert "no-such-model" in str(e), e

prompts = ["The agent called the tool", "Am frühen Morgen lag", "朝早く、川の上には", "이른 아침 강 위에는", "fn main() {"]

# completion, non-streaming and streaming: the joined stream equals the whole text
for p in prompts:
    whole = c.completions.create(model=model, prompt=p, max_tokens=24, temperature=0)
    assert whole.choices[0].finish_reason == "length", whole
    assert whole.usage.completion_tokens == 24, whole.usage
    parts = [ch.choices[0].text for ch in c.completions.create(model=model, prompt=p, max_tokens=24, temperature=0, stream=True)]
    assert "".join(parts) == whole.choices[0].text, (parts, whole.choices[0].text)
print("completions ok")

# a continuation's likelihood, as lm-evaluation-harness asks it: echo, logprobs, max_tokens 0/1
ll = c.completions.create(model=model, prompt="The agent keeps serving", max_tokens=0, echo=True, logprobs=1, temperature=0)
lp = ll.choices[0].logprobs
assert ll.choices[0].text == "The agent keeps serving", ll
assert lp.token_logprobs[0] is None and all(x <= 0 for x in lp.token_logprobs[1:]), lp
assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == ll.usage.prompt_tokens, (lp, ll.usage)
assert lp.text_offset[0] == 0 and lp.top_logprobs[0] is None and len(lp.top_logprobs[1]) == 1, lp
one = c.completions.create(model=model, prompt="The agent keeps serving", max_tokens=1, echo=True, logprobs=1, temperature=0)
assert one.choices[0].logprobs.token_logprobs[:-1] == lp.token_logprobs, (one, lp)
print("prompt logprobs ok")

# chat, non-streaming and streaming, with usage in the stream
msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Guten Morgen, wie geht es?"}]
whole = c.chat.completions.create(model=model, messages=msgs, max_tokens=20, temperature=0)
assert whole.choices[0].message.role == "assistant"
text = whole.choices[0].message.content
stream = c.chat.completions.create(model=model, messages=msgs, max_tokens=20, temperature=0, stream=True, stream_options={"include_usage": True})
parts, usage = [], None
for ch in stream:
    if ch.usage is not None:
        usage = ch.usage
    for choice in ch.choices:
        if choice.delta.content:
            parts.append(choice.delta.content)
assert "".join(parts) == text, (parts, text)
assert usage is not None and usage.completion_tokens == 20, usage
print("chat ok")

# seeded sampling is reproducible
a = c.completions.create(model=model, prompt="The agent", max_tokens=16, temperature=0.8, top_p=0.9, seed=7).choices[0].text
b = c.completions.create(model=model, prompt="The agent", max_tokens=16, temperature=0.8, top_p=0.9, seed=7).choices[0].text
assert a == b, (a, b)

# a stop string ends the text before it
full = c.completions.create(model=model, prompt="The agent called", max_tokens=30, temperature=0).choices[0].text
cut = full[5:8]
if cut.strip():
    s = c.completions.create(model=model, prompt="The agent called", max_tokens=30, temperature=0, stop=[cut])
    assert s.choices[0].text == full[: full.index(cut)], (s.choices[0].text, full, cut)
    assert s.choices[0].finish_reason == "stop"
print("sampling and stop ok")

# log-probabilities, n, penalties, logit_bias and echo through the client's own types
lp = c.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
content = lp.choices[0].logprobs.content
assert len(content) == lp.usage.completion_tokens, content
assert all(t.logprob <= 0 and len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob == t.logprob for t in content), content
assert lp.choices[0].message.content == text[: len(lp.choices[0].message.content)]
cl = c.completions.create(model=model, prompt="The agent", max_tokens=6, temperature=0, logprobs=3)
assert len(cl.choices[0].logprobs.tokens) == 6 and len(cl.choices[0].logprobs.top_logprobs[0]) == 3, cl
many_choices = c.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=1.0, seed=3, n=3)
assert [ch.index for ch in many_choices.choices] == [0, 1, 2], many_choices
assert many_choices.usage.completion_tokens == 24, many_choices.usage
idx = set()
for ch in c.chat.completions.create(model=model, messages=msgs, max_tokens=4, temperature=0, n=2, stream=True):
    for choice in ch.choices:
        idx.add(choice.index)
assert idx == {0, 1}, idx
biased = c.completions.create(model=model, prompt="The agent", max_tokens=8, temperature=0, logit_bias={"300": 100}, logprobs=0)
assert len(set(biased.choices[0].logprobs.tokens)) == 1, biased
pen = c.completions.create(model=model, prompt="The agent", max_tokens=8, temperature=0, frequency_penalty=1.5, presence_penalty=0.5)
assert pen.usage.completion_tokens == 8
echoed = c.completions.create(model=model, prompt="The agent", max_tokens=4, temperature=0, echo=True)
assert echoed.choices[0].text.startswith("The agent"), echoed
print("logprobs, n, penalties, bias, echo ok")

# structured output: the random weights answer JSON valid against the schema
import json as _json
schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
          "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
for seed in range(3):
    r = c.chat.completions.create(model=model, messages=msgs, max_tokens=200, temperature=1.0, seed=seed,
                                  response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}})
    assert r.choices[0].finish_reason == "stop", r
    obj = _json.loads(r.choices[0].message.content)
    assert set(obj) == {"name", "age"} and isinstance(obj["age"], int) and 0 <= obj["age"] <= 120, obj
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 16, obj
print("json_schema ok")

# tool calls: forced (required, a named function), streamed, and a result round trip
tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                         "required": ["city"], "additionalProperties": False}}}]
tc = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=tools,
                               tool_choice="required", parallel_tool_calls=False, max_tokens=200, temperature=0)
ch = tc.choices[0]
assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1, tc
call = ch.message.tool_calls[0]
assert call.function.name == "get_weather" and isinstance(_json.loads(call.function.arguments)["city"], str), call
named = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "Weather?"}], tools=tools,
                                  tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=200, temperature=0)
assert named.choices[0].message.tool_calls[0].function.name == "get_weather", named
parts = {}
for chunk in c.chat.completions.create(model=model, messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=tools,
                                       tool_choice="required", parallel_tool_calls=False, max_tokens=200, temperature=0, stream=True):
    for choice in chunk.choices:
        for d in choice.delta.tool_calls or []:
            p = parts.setdefault(d.index, {"name": "", "arguments": ""})
            p["name"] += d.function.name or ""
            p["arguments"] += d.function.arguments or ""
assert parts == {0: {"name": call.function.name, "arguments": call.function.arguments}}, (parts, call)
follow = c.chat.completions.create(model=model, tools=tools, max_tokens=8, messages=[
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": call.id, "type": "function",
        "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
    {"role": "tool", "tool_call_id": call.id, "content": "-3C, snow"}])
assert follow.choices[0].message.role == "assistant", follow
print("tool calls ok")

# the Responses API: text whole and streamed, a forced function call and its output, a schema
r = c.responses.create(model=model, input="Guten Morgen, wie geht es?", instructions="You are terse.", max_output_tokens=20)
assert r.status in ("completed", "incomplete") and r.usage.output_tokens <= 20, r
events = list(c.responses.create(model=model, input="Guten Morgen, wie geht es?", instructions="You are terse.",
                                 max_output_tokens=20, stream=True))
assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete"), events[-1]
assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text, (events, r.output_text)
assert events[-1].response.output_text == r.output_text
# a cut answer ends with response.incomplete, as OpenAI's does
assert events[-1].type == ("response.incomplete" if r.status == "incomplete" else "response.completed")
rtools = [{"type": "function", "name": "get_weather", "description": "Weather of a city", "strict": True,
           "parameters": tools[0]["function"]["parameters"]}]
# the SDK's stream helper (it rebuilds the response from the events) on an answer that completes
with c.responses.stream(model=model, input="Weather in Oslo?", tools=rtools, tool_choice="required",
                        parallel_tool_calls=False, max_output_tokens=200) as s:
    final = s.get_final_response()
assert final.status == "completed" and [o.type for o in final.output] == ["function_call"], final
rt = c.responses.create(model=model, input="Weather in Oslo?", tools=rtools, tool_choice="required",
                        parallel_tool_calls=False, max_output_tokens=200)
fcs = [o for o in rt.output if o.type == "function_call"]
assert len(fcs) == 1 and fcs[0].name == "get_weather" and isinstance(_json.loads(fcs[0].arguments)["city"], str), rt
rev = list(c.responses.create(model=model, input="Weather in Oslo?", tools=rtools, tool_choice="required",
                              parallel_tool_calls=False, max_output_tokens=200, stream=True))
streamed_calls = [e for e in rev if e.type == "response.function_call_arguments.done"]
assert [e.arguments for e in streamed_calls] == [fcs[0].arguments], streamed_calls
# the arguments arrive in pieces as they are written
arg_deltas = [e.delta for e in rev if e.type == "response.function_call_arguments.delta"]
assert len(arg_deltas) > 2 and "".join(arg_deltas) == fcs[0].arguments, arg_deltas
r2 = c.responses.create(model=model, tools=rtools, max_output_tokens=8, input=[
    {"role": "user", "content": "Weather in Oslo?"},
    {"type": "function_call", "call_id": fcs[0].call_id, "name": fcs[0].name, "arguments": fcs[0].arguments},
    {"type": "function_call_output", "call_id": fcs[0].call_id, "output": "-3C, snow"}])
assert r2.status in ("completed", "incomplete"), r2
rs = c.responses.create(model=model, input="A person as JSON", max_output_tokens=200,
                        text={"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}})
obj = _json.loads(rs.output_text)
assert set(obj) == {"name", "age"}, obj
try:
    c.responses.create(model=model, input="x", previous_response_id="resp_nope")
    raise SystemExit("expected BadRequestError")
except openai.BadRequestError as e:
    assert e.body["param"] == "previous_response_id" and "not found" in e.body["message"], e.body
# kept responses: a conversation through previous_response_id (the tool's output sent after
# its call), retrieve and delete
turn = c.responses.create(model=model, previous_response_id=rt.id, max_output_tokens=8, tools=rtools,
                          input=[{"type": "function_call_output", "call_id": fcs[0].call_id, "output": "-3C, snow"}])
assert turn.previous_response_id == rt.id and turn.status in ("completed", "incomplete"), turn
# the same conversation sent whole has the same prompt
assert turn.usage.input_tokens == r2.usage.input_tokens, (turn.usage, r2.usage)
assert c.responses.retrieve(turn.id).output_text == turn.output_text
# its input items through the SDK: the question, the call, the tool's output (oldest first)
items = list(c.responses.input_items.list(turn.id, order="asc"))
assert [i.type for i in items] == ["message", "function_call", "function_call_output"], items
assert items[1].call_id == fcs[0].call_id and items[2].output == "-3C, snow", items
page = c.responses.input_items.list(turn.id, limit=1)
assert [i.id for i in page.data] == [items[2].id] and page.has_more, page
# the pages chained by the SDK: all three, newest first
assert [i.id for i in page] == [i.id for i in reversed(items)], page
assert c.responses.retrieve(events[-1].response.id).id == events[-1].response.id  # streamed: kept too
c.responses.delete(turn.id)
try:
    c.responses.retrieve(turn.id)
    raise SystemExit("expected NotFoundError")
except openai.NotFoundError:
    pass
print("responses ok")

# an error case: the client raises the right exception
try:
    c.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    raise SystemExit("expected NotFoundError")
except openai.NotFoundError as e:
    assert "no-such-model" in str(e)
try:
    c.chat.completions.create(model=model, messages=[], max_tokens=2)
    raise SystemExit("expected BadRequestError")
except openai.BadRequestError:
    pass
print("errors ok")

# 32 concurrent streaming clients, zero errors, each stream complete
async def one(ac, i):
    p = prompts[i % len(prompts)]
    n, done = 0, None
    stream = await ac.chat.completions.create(model=model, messages=[{"role": "user", "content": p}], max_tokens=32, temperature=0, stream=True)
    async for ch in stream:
        for choice in ch.choices:
            if choice.finish_reason:
                done = choice.finish_reason
            if choice.delta.content:
                n += 1
    assert done == "length", done
    return n

async def many():
    ac = AsyncOpenAI(base_url=base, api_key="none", max_retries=0)
    res = await asyncio.gather(*[one(ac, i) for i in range(32)], return_exceptions=True)
    errors = [r for r in res if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    return res

res = asyncio.run(many())
print("32 concurrent streams ok", sum(res), "chunks")
print("ALL OK")
