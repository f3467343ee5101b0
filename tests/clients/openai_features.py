"""What clients send, through the official `openai` Python client, against a running pd router.

Usage: python3 tests/clients/openai_features.py http://127.0.0.1:PORT
Prints one line per check and exits non-zero on the first failure (tests/tests/cluster.rs
runs it against the real cluster: router, prefill worker, decode worker, real model).
"""

import json
import sys
import urllib.request

import openai
from checks import check

BASE = sys.argv[1].rstrip("/")
client = openai.OpenAI(base_url=BASE + "/v1", api_key="unused", max_retries=0, timeout=120)
MODEL = client.models.list().data[0].id
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def post(path, body):
    req = urllib.request.Request(BASE + path, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)


def chat(**kw):
    return client.chat.completions.create(model=MODEL, messages=kw.pop("messages", QUESTION), **kw)


# Log probabilities: greedy picks the most likely token, so each position's own logprob is
# its top alternative's; the first comes from the prefill worker, the rest from decode.
r = chat(max_tokens=12, temperature=0, logprobs=True, top_logprobs=3)
content = r.choices[0].logprobs.content
check("chat logprobs: one per token", len(content) == r.usage.completion_tokens, f"{len(content)} vs {r.usage}")
check("chat logprobs: 3 alternatives each", all(len(c.top_logprobs) == 3 for c in content))
check(
    "chat logprobs: greedy takes the top alternative",
    all(abs(c.logprob - c.top_logprobs[0].logprob) < 1e-5 and c.token == c.top_logprobs[0].token for c in content),
    [(c.token, c.logprob, c.top_logprobs[0]) for c in content][:3],
)
check("chat logprobs: probabilities", all(c.logprob <= 0 for c in content))
text_bytes = b"".join(bytes(c.bytes) for c in content)
check("chat logprobs: token bytes spell the text", text_bytes.decode("utf-8", "replace").startswith(r.choices[0].message.content), text_bytes)

streamed, stream_lp = "", []
for chunk in chat(max_tokens=12, temperature=0, logprobs=True, top_logprobs=3, stream=True):
    if chunk.choices and chunk.choices[0].delta.content is not None:
        streamed += chunk.choices[0].delta.content
    if chunk.choices and chunk.choices[0].logprobs:
        stream_lp += chunk.choices[0].logprobs.content
check("streamed chat: same text", streamed == r.choices[0].message.content, (streamed, r.choices[0].message.content))
check(
    "streamed chat: same logprobs",
    len(stream_lp) == len(content) and all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(stream_lp, content)),
)

c = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0, logprobs=2)
lp = c.choices[0].logprobs
check("completion logprobs: parallel lists", len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6)
check("completion logprobs: offsets", lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset))

# Seeds: random without one, repeatable with one.
def sampled(**kw):
    return chat(max_tokens=24, temperature=1.0, **kw).choices[0].message.content

a, b = sampled(), sampled()
check("unseeded requests differ", a != b, (a, b))
check("a seed repeats", sampled(seed=7) == sampled(seed=7))

# Penalties and biases change the output; min_tokens holds the end back.
def repeat(**kw):
    prompt = "1, 1, 1, 1, 1, 1, 1, 1, 1, 1,"
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, **kw).choices[0].text

plain = repeat()
check("a repetitive prompt repeats", plain.count("1") >= 4, plain)
for name, kw in [
    ("frequency_penalty", {"frequency_penalty": 2.0}),
    ("repetition_penalty (vLLM's)", {"extra_body": {"repetition_penalty": 1.8}}),
]:
    changed = repeat(**kw)
    check(f"{name} breaks the repetition", changed.count("1") < plain.count("1"), (plain, changed))
# Presence counts a token once: too weak to break this prompt greedily; with the same seed at
# temperature 1 it still changes what is drawn.
check("presence_penalty changes a seeded answer", sampled(seed=3) != sampled(seed=3, presence_penalty=2.0))
first = content[0]
banned = post("/tokenize", {"prompt": first.token})["tokens"]
check("/tokenize gives one id for one token", len(banned) == 1, banned)
other = chat(max_tokens=4, temperature=0, logit_bias={str(banned[0]): -100}, logprobs=True)
check("logit_bias -100 bans the greedy first token", other.choices[0].logprobs.content[0].token != first.token)
short = chat(max_tokens=40, temperature=0, extra_body={"min_tokens": 40, "ignore_eos": False})
check("min_tokens holds the end back", short.usage.completion_tokens == 40 and short.choices[0].finish_reason == "length", short.usage)

# Prompts as token ids; /tokenize and /detokenize; the model's context length.
ids = post("/tokenize", {"prompt": "The capital of France is"})
check("/tokenize counts and reports max_model_len", ids["count"] == len(ids["tokens"]) and ids["max_model_len"] > 0)
by_ids = client.completions.create(model=MODEL, prompt=ids["tokens"], max_tokens=6, temperature=0)
check("a token-id prompt answers as its text does", by_ids.choices[0].text == c.choices[0].text, (by_ids.choices[0].text, c.choices[0].text))
check("/detokenize inverts /tokenize", post("/detokenize", {"tokens": ids["tokens"]})["prompt"] == "The capital of France is")
templated = post("/tokenize", {"messages": QUESTION})
check("/tokenize renders chat the way chat requests are", templated["count"] == r.usage.prompt_tokens, (templated["count"], r.usage.prompt_tokens))
# Template arguments (vLLM's and SGLang's `chat_template_kwargs`): SmolLM2's template reads none
# of them, so the prompt and the greedy answer are the same as without.
kw = {"chat_template_kwargs": {"enable_thinking": False}}
with_kwargs = chat(max_tokens=6, temperature=0, extra_body=kw)
without = chat(max_tokens=6, temperature=0)
check("chat_template_kwargs are accepted", with_kwargs.choices[0].message.content == without.choices[0].message.content
      and with_kwargs.usage.prompt_tokens == without.usage.prompt_tokens, (with_kwargs, without))
check("/tokenize takes chat_template_kwargs", post("/tokenize", {"messages": QUESTION, **kw})["count"] == templated["count"])

# The caller's request id is a label; the response id is the router's.
raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=QUESTION, max_tokens=2, extra_headers={"x-request-id": "my-id"})
check("the response id is the router's own", raw.parse().id.startswith("req-") and raw.parse().id != "my-id")

# Structured output: every token constrained (the prefill worker's first one included), so
# the text always parses and validates, greedy or sampled, streamed or not.
from pydantic import BaseModel, Field


class City(BaseModel):
    # Bounded, so a sampled answer ends well within max_tokens.
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)
    population: int


ask_city = [{"role": "user", "content": "Describe Paris as JSON with its name, country and population."}]
parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
for temperature, seed in ((0.0, None), (1.0, 1), (1.0, 2)):
    parsed = parse(model=MODEL, messages=ask_city, response_format=City, max_tokens=120, temperature=temperature, seed=seed)
    city = parsed.choices[0].message.parsed
    check(f"json_schema via parse() at temperature {temperature}", isinstance(city, City), parsed.choices[0].message.content)
schema = City.model_json_schema()
text = ""
for chunk in chat(messages=ask_city, max_tokens=120, temperature=0, stream=True,
                  response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}}):
    if chunk.choices and chunk.choices[0].delta.content:
        text += chunk.choices[0].delta.content
check("streamed json_schema validates", isinstance(City.model_validate_json(text), City), text)
obj = chat(messages=ask_city, max_tokens=200, temperature=0, response_format={"type": "json_object"}).choices[0].message.content
check("json_object is a JSON object", isinstance(json.loads(obj), dict), obj)
choice = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=1.0,
                                   extra_body={"guided_choice": ["Paris", "London", "Rome"]}).choices[0].text
check("guided_choice picks one of the choices", choice in ("Paris", "London", "Rome"), choice)
digits = client.completions.create(model=MODEL, prompt="My phone number is", max_tokens=12, temperature=1.0,
                                   extra_body={"guided_regex": "[0-9]{3}-[0-9]{4}"}).choices[0].text
import re
check("guided_regex matches whole", re.fullmatch(r"[0-9]{3}-[0-9]{4}", digits) is not None, digits)

# Tools: a named function or `required` is enforced by the constraint, so the call always
# parses and matches the schema; a multi-turn conversation carries the call and its result.
weather = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ask = [{"role": "user", "content": "What is the weather in Paris?"}]
for tool_choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
    r = chat(messages=ask, tools=[weather], tool_choice=tool_choice, max_tokens=60, temperature=0.7, seed=1)
    calls = r.choices[0].message.tool_calls
    check(f"tool_choice {tool_choice if isinstance(tool_choice, str) else 'named'} gives a call",
          r.choices[0].finish_reason == "tool_calls" and len(calls) == 1 and calls[0].function.name == "get_weather", r)
    args = json.loads(calls[0].function.arguments)
    check("the call's arguments match the schema", isinstance(args.get("city"), str), args)
# Streamed, the call arrives as OpenAI streams it: a first delta with its id and name, then
# the arguments in pieces as the model writes them, adding up to the whole answer's.
whole = chat(messages=ask, tools=[weather], tool_choice="required", max_tokens=60, temperature=0)
pieces, finish, positions, used = [], None, 0, None
for chunk in chat(messages=ask, tools=[weather], tool_choice="required", max_tokens=60, temperature=0, stream=True,
                  logprobs=True, stream_options={"include_usage": True}):
    if chunk.usage:
        used = chunk.usage.completion_tokens
    if chunk.choices and chunk.choices[0].delta.tool_calls:
        pieces += chunk.choices[0].delta.tool_calls
    if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
        positions += len(chunk.choices[0].logprobs.content)
    if chunk.choices and chunk.choices[0].finish_reason:
        finish = chunk.choices[0].finish_reason
check("streamed tool calls with logprobs: one position per generated token", positions == used, (positions, used))
check("streamed tool calls arrive as delta.tool_calls", finish == "tool_calls" and pieces and pieces[0].function.name == "get_weather" and pieces[0].id, pieces)
arguments = "".join(p.function.arguments or "" for p in pieces)
check("streamed arguments come in several deltas and add up to the whole answer's",
      len(pieces) > 2 and all(p.index == 0 for p in pieces) and all(p.id is None for p in pieces[1:])
      and arguments == whole.choices[0].message.tool_calls[0].function.arguments, (arguments, pieces))
# With `auto` the model chooses; streamed, its answer is what the whole answer is.
auto_whole = chat(messages=ask, tools=[weather], max_tokens=40, temperature=0).choices[0]
content, auto_pieces, auto_finish = "", [], None
for chunk in chat(messages=ask, tools=[weather], max_tokens=40, temperature=0, stream=True):
    if chunk.choices:
        content += chunk.choices[0].delta.content or ""
        auto_pieces += chunk.choices[0].delta.tool_calls or []
        auto_finish = chunk.choices[0].finish_reason or auto_finish
check("tool_choice auto streamed answers as the whole answer does",
      (content or None) == (auto_whole.message.content or None) and auto_finish == auto_whole.finish_reason
      and len([p for p in auto_pieces if p.id]) == len(auto_whole.message.tool_calls or []), (content, auto_pieces, auto_whole))
turns = ask + [
    {"role": "assistant", "content": None, "tool_calls": [{"id": calls[0].id, "type": "function", "function": {"name": "get_weather", "arguments": calls[0].function.arguments}}]},
    {"role": "tool", "tool_call_id": calls[0].id, "content": json.dumps({"temperature_c": 21, "sky": "sunny"})},
]
final = chat(messages=turns, tools=[weather], tool_choice="none", max_tokens=40, temperature=0)
check("a tool result turn is answered in text", final.choices[0].finish_reason in ("stop", "length") and final.choices[0].message.content, final)
for name, kw, param in [
    ("an unknown function in tool_choice", {"tools": [weather], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ("a tool message without tool_call_id", {"messages": ask + [{"role": "tool", "content": "x"}]}, "tool_call_id"),
]:
    try:
        chat(max_tokens=2, **kw)
        check(name, False, "accepted")
    except openai.BadRequestError as e:
        check(name + " is a 400 naming the field", param in str(e), str(e))

# n answers from one prefill (the prompt's KV shipped once, shared on the decode worker):
# greedy answers all equal the single answer, sampled ones differ and replay from the seed,
# streamed ones arrive by index; the prompt is counted once.
one = chat(max_tokens=12, temperature=0)
many = chat(max_tokens=12, temperature=0, n=3)
check("n=3: choices by index", [c.index for c in many.choices] == [0, 1, 2], many.choices)
check("n=3 greedy: each equals the single answer", all(c.message.content == one.choices[0].message.content for c in many.choices), many.choices)
check("n=3: the prompt counted once", many.usage.prompt_tokens == one.usage.prompt_tokens and many.usage.completion_tokens == 3 * one.usage.completion_tokens, many.usage)
seeded = [c.message.content for c in chat(max_tokens=24, temperature=1.0, n=4, seed=11).choices]
check("n=4 sampled: the answers differ", len(set(seeded)) >= 3, seeded)
check("n=4 sampled: a seed repeats every answer", [c.message.content for c in chat(max_tokens=24, temperature=1.0, n=4, seed=11).choices] == seeded)
by_index, finishes, usage = {}, {}, None
for chunk in chat(max_tokens=24, temperature=1.0, n=4, seed=11, stream=True, stream_options={"include_usage": True}):
    for ch in chunk.choices:
        by_index[ch.index] = by_index.get(ch.index, "") + (ch.delta.content or "")
        if ch.finish_reason:
            finishes[ch.index] = ch.finish_reason
    usage = chunk.usage or usage
check("n=4 streamed: the same answers by index", [by_index.get(i) for i in range(4)] == seeded, by_index)
check("n=4 streamed: every answer finishes", sorted(finishes) == [0, 1, 2, 3], finishes)
check("n=4 streamed: usage counts every answer", usage is not None and usage.completion_tokens >= 4, usage)
texts = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0.8, n=2, seed=3, logprobs=1)
check("completions n=2 with logprobs", len(texts.choices) == 2 and all(len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) > 0 for c in texts.choices), texts)

# echo + logprobs: the prompt's own tokens scored on a prefill worker (what evaluation
# harnesses send for a loglikelihood). The prompt is a greedy continuation, so its scored
# tail must agree with the logprobs the generation reported for those tokens.
start = "The capital of France is"
gen = client.completions.create(model=MODEL, prompt=start, max_tokens=6, temperature=0, logprobs=1)
whole = start + gen.choices[0].text
scored = client.completions.create(model=MODEL, prompt=whole, echo=True, logprobs=1, max_tokens=0)
lp = scored.choices[0].logprobs
check("echo: the text is the prompt", scored.choices[0].text == whole, scored.choices[0].text)
check("echo: one position per prompt token", len(lp.tokens) == scored.usage.prompt_tokens and scored.usage.completion_tokens == 0, scored.usage)
check("echo: the first token has no logprob", lp.token_logprobs[0] is None and lp.top_logprobs[0] is None, lp.token_logprobs[:2])
tail, generated = lp.token_logprobs[-6:], gen.choices[0].logprobs.token_logprobs
check("echo: the generated tail scores as it was generated", all(abs(a - b) < 0.05 for a, b in zip(tail, generated)), (tail, generated))
check("echo: greedy tail tokens are each position's top", all(abs(l - max(t.values())) < 1e-4 for l, t in zip(lp.token_logprobs[-6:], lp.top_logprobs[-6:])))
one = client.completions.create(model=MODEL, prompt=start, echo=True, logprobs=0, max_tokens=1, temperature=0)
check("echo with max_tokens 1: prompt then the greedy token", one.choices[0].text == start + gen.choices[0].text[: len(one.choices[0].text) - len(start)] and one.usage.completion_tokens == 1, one.choices[0].text)
# echo that also generates: the prompt (scored, first token null), then an ordinary
# generation after it, whole or streamed, with n answers each starting with the prompt.
more = client.completions.create(model=MODEL, prompt=start, echo=True, logprobs=1, max_tokens=6, temperature=0)
ml = more.choices[0].logprobs
check("echo with max_tokens 6: the prompt then the greedy answer", more.choices[0].text == whole and more.usage.completion_tokens == 6, more.choices[0].text)
check("echo with max_tokens 6: the prompt's logprobs then the answer's", len(ml.tokens) == more.usage.prompt_tokens + 6 and ml.token_logprobs[0] is None
      and all(abs(a - b) < 1e-4 for a, b in zip(ml.token_logprobs[-6:], generated)), ml.token_logprobs)
streamed, streamed_lp = "", []
for chunk in client.completions.create(model=MODEL, prompt=start, echo=True, logprobs=1, max_tokens=6, temperature=0, stream=True):
    if chunk.choices:
        streamed += chunk.choices[0].text
        if chunk.choices[0].logprobs:
            streamed_lp += chunk.choices[0].logprobs.token_logprobs
check("echo streamed: the same text and logprobs", streamed == whole and streamed_lp == ml.token_logprobs, (streamed, streamed_lp))
two = client.completions.create(model=MODEL, prompt=start, echo=True, max_tokens=6, temperature=0, n=2)
check("echo with n 2: each answer starts with the prompt", [c.text for c in two.choices] == [whole, whole], two.choices)
for name, kw, param in [
    ("echo streamed with max_tokens 0", {"max_tokens": 0, "stream": True}, "stream"),
    ("echo with n 2 and max_tokens 0", {"max_tokens": 0, "n": 2}, "n"),
]:
    try:
        client.completions.create(model=MODEL, prompt=start, echo=True, logprobs=1, **kw)
        check(name, False, "accepted")
    except openai.BadRequestError as e:
        check(name + " is a 400 naming the field", param in str(e), str(e))

# A list of prompts: one request each in the cluster, choices numbered prompt by prompt
# (prompt i's answer j is choice i * n + j), usage summed; the shape evaluation harnesses send.
prompts = ["The capital of France is", "Water boils at"]
singles = [client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0).choices[0].text for p in prompts]
both = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0, n=2)
check("a list of prompts: n answers each, in order", [c.text for c in sorted(both.choices, key=lambda c: c.index)] == [singles[0]] * 2 + [singles[1]] * 2, both.choices)
streamed = {}
for chunk in client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0, stream=True):
    for ch in chunk.choices:
        streamed[ch.index] = streamed.get(ch.index, "") + ch.text
check("a list of prompts streamed by index", [streamed.get(0), streamed.get(1)] == singles, streamed)
harness = client.completions.create(model=MODEL, prompt=prompts, temperature=0, max_tokens=1, logprobs=1, seed=1234, echo=True)
check("an evaluation harness's echo batch: every prompt scored", len(harness.choices) == 2 and all(c.logprobs.token_logprobs[0] is None and len(c.logprobs.tokens) >= 3 for c in harness.choices), harness.choices)

# Refused by name, nothing reaches a worker.
for name, kw, param in [
    ("n above the router's maximum", {"n": 99}, "n"),
    ("top_logprobs above 20", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("frequency_penalty out of range", {"frequency_penalty": 2.5}, "frequency_penalty"),
    ("logit_bias outside the vocabulary", {"logit_bias": {"99999999": 1}}, "logit_bias"),
    ("a schema that does not compile", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}}, "response_format.json_schema.schema"),
    ("two constraints at once", {"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a+"}}, "guided_regex"),
    ("a template argument the server sets", {"extra_body": {"chat_template_kwargs": {"add_generation_prompt": False}}}, "chat_template_kwargs.add_generation_prompt"),
]:
    try:
        chat(max_tokens=2, **kw)
        check(name, False, "accepted")
    except openai.BadRequestError as e:
        check(name + " is a 400 naming the field", param in str(e), str(e))
print("all passed")
