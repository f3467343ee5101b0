"""A thinking model's reasoning block returned apart, with the official `openai` Python client.

Usage: python3 tests/clients/reasoning.py http://127.0.0.1:PORT
tests/tests/cluster.rs runs it against the real cluster whose router serves Qwen3's chat
template (`--chat-template`). SmolLM2 does not think on its own, so a `guided_regex` makes it
write a `<think>` block and then the answer; the router returns the block as
`reasoning_content` (vLLM's and SGLang's field) and the rest as `content`, whole and streamed.
Exits non-zero on the first failure.
"""

import re
import sys

import openai
from checks import check

BASE = sys.argv[1].rstrip("/")
client = openai.OpenAI(base_url=BASE + "/v1", api_key="unused", max_retries=0, timeout=120)
MODEL = client.models.list().data[0].id
ask = [{"role": "user", "content": "What is the capital of France? Think first."}]
THINKING = r"<think>\n[a-z ]{4,40}\n</think>\n\n[A-Z][a-z]{2,20}\."


def chat(**kw):
    return client.chat.completions.create(model=MODEL, messages=kw.pop("messages", ask), max_tokens=48,
                                          temperature=0, **kw)


r = chat(extra_body={"guided_regex": THINKING}).choices[0]
reasoning = (r.message.model_extra or {}).get("reasoning_content")
check("the block comes back as reasoning_content", isinstance(reasoning, str)
      and re.fullmatch(r"\n[a-z ]{4,40}\n", reasoning) is not None, r.message)
check("content is the answer alone", re.fullmatch(r"[A-Z][a-z]{2,20}\.", r.message.content or "") is not None,
      r.message)
thought, said = "", ""
for chunk in chat(extra_body={"guided_regex": THINKING}, stream=True):
    if chunk.choices:
        delta = chunk.choices[0].delta
        thought += (delta.model_extra or {}).get("reasoning_content") or ""
        said += delta.content or ""
check("streamed, reasoning and content deltas add up to the whole answer's", (thought, said) == (reasoning,
      r.message.content), (thought, said))
# Qwen3's own switch: with thinking off its template closes an empty block in the prompt.
r = chat(extra_body={"guided_regex": r"[A-Z][a-z]{2,20}\.", "chat_template_kwargs": {"enable_thinking": False}})
check("thinking off: no reasoning_content", "reasoning_content" not in (r.choices[0].message.model_extra or {})
      and r.choices[0].message.content, r.choices[0].message)
# The next turn carries the reasoning back, as clients resend the assistant message.
turns = ask + [{"role": "assistant", "content": "Paris.", "reasoning_content": reasoning},
               {"role": "user", "content": "And of Italy?"}]
r = chat(messages=turns, extra_body={"guided_regex": THINKING})
check("an assistant turn with reasoning_content is accepted", r.choices[0].message.content, r)
print("all passed")
