"""Drives a running moelane gateway's Messages API with the real `anthropic` Python client.
Usage: python3 anthropic_client.py http://127.0.0.1:PORT"""
import json
import sys

import anthropic

base = sys.argv[1]
c = anthropic.Anthropic(base_url=base, api_key="none", max_retries=0)
model = "tiny"
msgs = [{"role": "user", "content": "Guten Morgen, wie geht es?"}]

# a whole answer, and the same streamed
m = c.messages.create(model=model, max_tokens=20, messages=msgs, system="You are terse.")
assert m.type == "message" and m.role == "assistant", m
assert m.stop_reason in ("max_tokens", "end_turn"), m
assert m.usage.output_tokens <= 20 and m.usage.input_tokens > 0, m.usage
text = "".join(b.text for b in m.content if b.type == "text")
with c.messages.stream(model=model, max_tokens=20, messages=msgs, system="You are terse.") as s:
    streamed = "".join(s.text_stream)
    final = s.get_final_message()
assert streamed == text, (streamed, text)
assert final.stop_reason == m.stop_reason and final.usage.output_tokens == m.usage.output_tokens, final
# a stop sequence ends the answer before it and is named, whole and streamed (two to choose from)
long = c.messages.create(model=model, max_tokens=30, messages=msgs)
full = "".join(b.text for b in long.content if b.type == "text")
cuts = [full[i:i + 3] for i in range(1, len(full) - 3) if full[i:i + 3].strip() and full.index(full[i:i + 3]) == i]
assert cuts, full
cut = cuts[0]
stopped = c.messages.create(model=model, max_tokens=30, messages=msgs, stop_sequences=["\u2603never", cut])
assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == cut, stopped
assert "".join(b.text for b in stopped.content if b.type == "text") == full[: full.index(cut)], stopped
with c.messages.stream(model=model, max_tokens=30, messages=msgs, stop_sequences=["\u2603never", cut]) as s:
    fin = s.get_final_message()
assert fin.stop_reason == "stop_sequence" and fin.stop_sequence == cut, fin
print("stop_sequence ok")
print("messages ok")

# tool use: forced (any, a named tool), whole and streamed, and the result round trip
tools = [{"name": "get_weather", "description": "Weather of a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                           "required": ["city"], "additionalProperties": False}}]
t = c.messages.create(model=model, max_tokens=200, messages=[{"role": "user", "content": "Weather in Oslo?"}],
                      tools=tools, tool_choice={"type": "any", "disable_parallel_tool_use": True})
assert t.stop_reason == "tool_use", t
uses = [b for b in t.content if b.type == "tool_use"]
assert len(uses) == 1 and uses[0].name == "get_weather" and isinstance(uses[0].input["city"], str), t
named = c.messages.create(model=model, max_tokens=200, messages=[{"role": "user", "content": "Weather?"}],
                          tools=tools, tool_choice={"type": "tool", "name": "get_weather"})
assert [b.name for b in named.content if b.type == "tool_use"] == ["get_weather"], named
with c.messages.stream(model=model, max_tokens=200, messages=[{"role": "user", "content": "Weather in Oslo?"}],
                       tools=tools, tool_choice={"type": "any", "disable_parallel_tool_use": True}) as s:
    pieces = [e.partial_json for e in s if e.type == "input_json"]
    fm = s.get_final_message()
su = [b for b in fm.content if b.type == "tool_use"]
assert fm.stop_reason == "tool_use" and len(su) == 1 and su[0].input == uses[0].input, (fm, uses)
# the input arrives as it is written, in pieces that add up to it
assert len(pieces) > 2 and json.loads("".join(pieces)) == uses[0].input, pieces
follow = c.messages.create(model=model, max_tokens=8, tools=tools, messages=[
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": [{"type": "tool_use", "id": uses[0].id, "name": "get_weather", "input": uses[0].input}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "-3C, snow"}]}])
assert follow.role == "assistant", follow
print("tool use ok")

# structured output: output_config's JSON schema
schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["name", "n"], "additionalProperties": False}
o = c.messages.create(model=model, max_tokens=100, messages=msgs,
                      output_config={"format": {"type": "json_schema", "schema": schema}})
obj = json.loads("".join(b.text for b in o.content if b.type == "text"))
assert set(obj) == {"name", "n"} and 0 <= obj["n"] <= 9, obj
print("output_config ok")

# count_tokens: the input tokens the same request takes, tools included (nothing generated)
n = c.messages.count_tokens(model=model, messages=msgs, system="You are terse.")
assert n.input_tokens == m.usage.input_tokens, (n, m.usage)
wx = [{"role": "user", "content": "Weather in Oslo?"}]
with_tools = c.messages.count_tokens(model=model, messages=wx, tools=tools, tool_choice={"type": "any"})
assert with_tools.input_tokens == t.usage.input_tokens, (with_tools, t.usage)
assert with_tools.input_tokens > c.messages.count_tokens(model=model, messages=wx).input_tokens
try:
    c.messages.count_tokens(model="no-such-model", messages=msgs)
    raise SystemExit("expected NotFoundError")
except anthropic.NotFoundError:
    pass
print("count_tokens ok")

# errors come back as the client's exceptions
try:
    c.messages.create(model="no-such-model", max_tokens=2, messages=msgs)
    raise SystemExit("expected NotFoundError")
except anthropic.NotFoundError:
    pass
# top_k 1 draws only the most probable token: the greedy answer, at any temperature (in the
# body: this client's signature has dropped the sampling fields)
greedy = c.messages.create(model=model, max_tokens=12, messages=msgs, extra_body={"temperature": 0})
k1 = c.messages.create(model=model, max_tokens=12, messages=msgs, extra_body={"temperature": 1.0, "top_k": 1})
assert [b.text for b in k1.content] == [b.text for b in greedy.content], (k1, greedy)
try:
    c.messages.create(model=model, max_tokens=2, messages=msgs, extra_body={"top_k": 2.5})
    raise SystemExit("expected BadRequestError")
except anthropic.BadRequestError as e:
    assert "top_k" in str(e), e
# the chat route's checks answer in this API's names
for kw, name in [({"stop_sequences": ["a", "b", "c", "d", "e"]}, "stop_sequences"),
                 ({"tool_choice": {"type": "any"}}, "type any")]:
    try:
        c.messages.create(model=model, max_tokens=2, messages=msgs, **kw)
        raise SystemExit(f"expected BadRequestError for {kw}")
    except anthropic.BadRequestError as e:
        assert name in str(e) and "`stop`" not in str(e) and "required" not in str(e), e
print("ALL OK")
