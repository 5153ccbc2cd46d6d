#!/usr/bin/env python3
"""Reference renderings of conversations with tools, tool calls and tool results, for Specula's
chat-template tests (models/src/chat.rs).

    /work/venv-ref/bin/python scripts/reference/chat_tools_fixtures.py   # (any venv with
                                                                        #  transformers, jinja2, gguf)

Writes tests/fixtures/tokenizer/qwen2.5-coder-0.5b.tools.json ([{messages, tools,
add_generation_prompt, rendered}]). The reference is transformers' own `render_jinja_template`
(what `apply_chat_template(..., tools=...)` calls) on the chat template stored in the GGUF, with
the tools as the list of {type, function} dicts and tool-call arguments as dicts, exactly as
transformers passes them.
"""

import json
from pathlib import Path

from gguf import GGUFReader
from transformers.utils.chat_template_utils import render_jinja_template

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / "models" / "cache"
OUT = ROOT / "tests" / "fixtures" / "tokenizer"

WEATHER = {"type": "function", "function": {
    "name": "get_weather",
    "description": "Get the current weather in a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "description": "City name"},
                                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Current time",
                                         "parameters": {"type": "object", "properties": {}}}}


def call(cid, name, args):
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


CONVERSATIONS = [
    ([{"role": "user", "content": "What is the weather in Paris?"}], [WEATHER], True),
    ([{"role": "system", "content": "You are terse."},
      {"role": "user", "content": "Weather in Paris? And the time — ünïcode ok?"}],
     [WEATHER, TIME], True),
    ([{"role": "user", "content": "Weather in Paris and Rome?"},
      {"role": "assistant", "content": "",
       "tool_calls": [call("call_1", "get_weather", {"city": "Paris"}),
                      call("call_2", "get_weather", {"city": "Rome", "unit": "celsius"})]},
      {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 18}"},
      {"role": "tool", "tool_call_id": "call_2", "content": "21 C"}],
     [WEATHER], True),
    ([{"role": "user", "content": "Time?"},
      {"role": "assistant", "content": "Checking.", "tool_calls": [call("c", "get_time", {})]},
      {"role": "tool", "tool_call_id": "c", "content": "12:00"},
      {"role": "assistant", "content": "It is noon."},
      {"role": "user", "content": "Thanks"}],
     [TIME], False),
]


def main():
    r = GGUFReader(str(CACHE / "qwen2.5-coder-0.5b.gguf"))
    f = r.fields["tokenizer.chat_template"]
    template = bytes(f.parts[f.data[0]]).decode()
    rows = []
    for messages, tools, gen in CONVERSATIONS:
        out, _ = render_jinja_template(conversations=[messages], tools=tools,
                                       chat_template=template, add_generation_prompt=gen)
        rows.append({"messages": messages, "tools": tools, "add_generation_prompt": gen,
                     "rendered": out[0]})
    body = ",\n".join(json.dumps(r, ensure_ascii=False) for r in rows)
    (OUT / "qwen2.5-coder-0.5b.tools.json").write_text(f"[\n{body}\n]\n")
    print(f"wrote {len(rows)} renderings")


if __name__ == "__main__":
    main()
