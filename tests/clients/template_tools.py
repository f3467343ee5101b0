"""Tool calls through a router serving another model's chat template (`--chat-template`), with
the official `openai` Python client.

Usage: python3 tests/clients/template_tools.py http://127.0.0.1:PORT
tests/tests/cluster.rs runs it against the real cluster whose router was started with
`--chat-template engine/tests/data/chat_templates/microsoft-Phi-4-mini-instruct.jinja`: the
tools go in the system message's own field, a required call is written `functools[...]`,
and the client gets OpenAI's `tool_calls`, whole and streamed. Exits non-zero on the first
failure.
"""

import json
import sys

import openai
from checks import check

BASE = sys.argv[1].rstrip("/")
client = openai.OpenAI(base_url=BASE + "/v1", api_key="unused", max_retries=0, timeout=120)
MODEL = client.models.list().data[0].id


weather = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ask = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the weather in Paris?"}]


def chat(**kw):
    return client.chat.completions.create(model=MODEL, messages=ask, tools=[weather], max_tokens=60, **kw)


for tool_choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
    r = chat(tool_choice=tool_choice, temperature=0)
    choice = r.choices[0]
    calls = choice.message.tool_calls or []
    check(f"tool_choice {tool_choice if isinstance(tool_choice, str) else 'named'}: one get_weather call",
          choice.finish_reason == "tool_calls" and len(calls) == 1 and calls[0].function.name == "get_weather", r)
    check("its arguments match the schema", isinstance(json.loads(calls[0].function.arguments).get("city"), str),
          calls[0].function.arguments)
    check("nothing of the functools[...] text is left as content", not choice.message.content, choice.message)
# The model's own text (its tokens, through logprobs) is the template's call form, not Hermes.
raw = "".join(t.token for t in chat(tool_choice="required", temperature=0, logprobs=True).choices[0].logprobs.content)
check("the answer was written functools[...]", raw.startswith("functools[{") and "<tool_call>" not in raw, raw)
whole = chat(tool_choice="required", temperature=0).choices[0].message.tool_calls[0]
pieces, finish = [], None
for chunk in chat(tool_choice="required", temperature=0, stream=True):
    if chunk.choices and chunk.choices[0].delta.tool_calls:
        pieces += chunk.choices[0].delta.tool_calls
    if chunk.choices and chunk.choices[0].finish_reason:
        finish = chunk.choices[0].finish_reason
arguments = "".join(p.function.arguments or "" for p in pieces)
check("streamed, the call arrives as delta.tool_calls adding up to the whole answer's",
      finish == "tool_calls" and pieces and pieces[0].function.name == "get_weather"
      and arguments == whole.function.arguments, (finish, pieces))
# The conversation goes on: the earlier call and its result are accepted in the template's form.
turns = ask + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": whole.id, "type": "function", "function": {"name": "get_weather", "arguments": whole.function.arguments}}]},
    {"role": "tool", "tool_call_id": whole.id, "content": '{"sky": "clear", "celsius": 18}'},
]
r = client.chat.completions.create(model=MODEL, messages=turns, tools=[weather], tool_choice="none", max_tokens=16,
                                   temperature=0)
check("a tool-result turn is answered with text", r.choices[0].finish_reason in ("stop", "length")
      and r.choices[0].message.content, r)
print("all passed")
