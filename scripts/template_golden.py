#!/usr/bin/env python3
"""Renders each family's chat template (crates/text/src/templates/*.jinja) through
transformers' chat-template machinery (the Jinja2 environment and render function behind
`apply_chat_template`) over a fixed set of conversations, and writes the inputs and the texts
to crates/text/tests/golden/templates.json. `cargo test -p moelane-text --test
template_golden` renders the same conversations with moelane's renderer and asserts the same
bytes (or the same refusal, where the template raises).

Regenerate (nothing else needs transformers; torch is not needed):
    python3 -m venv target/tplenv && target/tplenv/bin/pip install transformers jinja2
    target/tplenv/bin/python scripts/template_golden.py
"""
import json
import os
import sys

from transformers.utils.chat_template_utils import render_jinja_template

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
TEMPLATES = os.path.join(ROOT, "crates", "text", "src", "templates")
OUT = os.path.join(ROOT, "crates", "text", "tests", "golden", "templates.json")
# not a family's: the Jinja features hub templates use (filters, loop variables, Python
# methods, printing values), so the renderer is checked beyond what our templates write
FEATURES = os.path.join(ROOT, "crates", "text", "tests", "golden", "features.jinja")

FAMILIES = {
    # model_type: (bos_token, eos_token)
    "qwen3_moe": ("", "<|im_end|>"),
    "qwen2_moe": ("", "<|im_end|>"),
    "mixtral": ("<s>", "</s>"),
    "glm4_moe": ("", "<|endoftext|>"),
    "deepseek_v3": ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    "gpt_oss": ("<|startoftext|>", "<|return|>"),
    "features": ("<s>", "</s>"),
}

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather",
        "description": "The weather of a city <now>, in 'C' & \"F\": été",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "The city"},
            "unit": {"type": "string", "enum": ["c", "f"]},
            "days": {"type": "integer", "minimum": 1}},
            "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "add",
        "parameters": {"type": "object", "properties": {
            "a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}},
]


def call(i, name, args):
    return {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": args}}


# Messages carry the fields moelane's ChatMessage carries: content always (a string),
# the others only when set.
CASES = [
    {"name": "plain", "messages": [{"role": "user", "content": "Hello!"}]},
    {"name": "system", "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is MoE?"}]},
    {"name": "multi_turn", "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello. How can I help?"},
        {"role": "user", "content": "Say 'ok' <twice> & \"quote\" ünïcode"}]},
    {"name": "multi_turn_no_prompt", "add_generation_prompt": False, "messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."}]},
    {"name": "reasoning_back", "messages": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Two and two."},
        {"role": "user", "content": "And 3+3?"}]},
    {"name": "tools", "tools": True, "messages": [
        {"role": "user", "content": "Weather in Oslo?"}]},
    {"name": "tools_system", "tools": True, "messages": [
        {"role": "system", "content": "You check the weather."},
        {"role": "user", "content": "Weather in Oslo?"}]},
    {"name": "tool_round_trip", "tools": True, "messages": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [
            call(1, "get_weather", {"city": "Oslo", "days": 2})]},
        {"role": "tool", "content": "-3C, snow", "tool_call_id": "call_1"}]},
    {"name": "parallel_calls_answered", "tools": True, "add_generation_prompt": False,
     "messages": [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Oslo and 2+3?"},
        {"role": "assistant", "content": "", "tool_calls": [
            call(1, "get_weather", {"city": "Oslo", "unit": "c"}),
            call(2, "add", {"a": 2, "b": 3.5})]},
        {"role": "tool", "content": "-3C", "tool_call_id": "call_1"},
        {"role": "tool", "content": "5.5", "tool_call_id": "call_2", "name": "add"},
        {"role": "assistant", "content": "It is -3C in Oslo; 2+3.5 is 5.5."}]},
    {"name": "call_with_text", "tools": True, "messages": [
        {"role": "user", "content": "Add 1 and 2"},
        {"role": "assistant", "content": "Let me add.", "tool_calls": [
            call(7, "add", {"a": 1, "b": 2})]},
        {"role": "tool", "content": "3", "tool_call_id": "call_7"},
        {"role": "user", "content": "Thanks"}]},
    {"name": "no_thinking", "kwargs": {"enable_thinking": False}, "messages": [
        {"role": "user", "content": "Quick: capital of France?"}]},
    {"name": "thinking", "kwargs": {"enable_thinking": True, "thinking": True,
                                    "reasoning_effort": "high"}, "messages": [
        {"role": "user", "content": "Think: capital of France?"}]},
    {"name": "starts_with_assistant", "messages": [
        {"role": "assistant", "content": "Hi there."},
        {"role": "user", "content": "Hi"}]},
]


def render(template, bos, eos, case):
    tools = TOOLS if case.get("tools") else None
    try:
        out = render_jinja_template(
            conversations=[case["messages"]], tools=tools, chat_template=template,
            add_generation_prompt=case.get("add_generation_prompt", True),
            bos_token=bos, eos_token=eos, **case.get("kwargs", {}))
        # transformers returns (rendered, generation_indices)
        text = out[0] if isinstance(out, tuple) else out
        return {"text": text[0] if isinstance(text, list) else text}
    except Exception as e:  # the template raised (raise_exception) or failed
        return {"error": str(e)}


def main():
    families = {}
    for family, (bos, eos) in FAMILIES.items():
        path = FEATURES if family == "features" else os.path.join(TEMPLATES, family + ".jinja")
        with open(path, encoding="utf-8") as f:
            template = f.read()
        families[family] = {"bos_token": bos, "eos_token": eos,
                            "renders": {c["name"]: render(template, bos, eos, c) for c in CASES}}
    golden = {"generated_by": "scripts/template_golden.py",
              "tools": TOOLS, "cases": CASES, "families": families}
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w", encoding="utf-8") as f:
        json.dump(golden, f, ensure_ascii=False, indent=1)
        f.write("\n")
    errors = sum("error" in r for fam in families.values() for r in fam["renders"].values())
    print(f"wrote {OUT}: {len(families)} families x {len(CASES)} conversations ({errors} refused)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
