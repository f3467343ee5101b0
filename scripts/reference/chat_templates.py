"""Renders the real chat templates in engine/tests/data/chat_templates/ (the models' own, copied
unchanged from packages on PyPI: most as llama.cpp keeps them in models/templates, from the
llama-cpp-python 0.3.36 sdist; google-gemma-3-4b-it from xinference 4.1.0's
model/llm/models/gemma-3-it.json, the `chat_template` of gemma-3's tokenizer_config.json;
microsoft-Phi-4-mini-instruct from guidance 0.3.1's chat.py, `phi_4_mini_template`, copied there
from Phi-4-mini-instruct's tokenizer_config.json) the way Hugging Face
transformers' `apply_chat_template` does (its own `render_jinja_template`, called with the
template text, so no tokenizer is downloaded) for a fixed set of conversations, and writes
engine/tests/data/chat_templates/expected.json, which engine/tests/chat_templates.rs compares
pd's rendering with. It also records whether each template reads the `tools` variable (jinja2's
own `meta.find_undeclared_variables`): where it does not, pd describes the tools itself. Run by hand (transformers is not a CI dependency):

  target/refenv/bin/python scripts/reference/chat_templates.py

`strftime_now` is pinned to NOW (transformers reads the local clock; pd the UTC one), and the
test gives pd the same instant with `ChatTemplate::with_now`.
"""

import calendar
import datetime as dt
import json
import pathlib

import jinja2
import jinja2.ext
import jinja2.meta
import transformers
from transformers.utils import chat_template_utils as ctu

ROOT = pathlib.Path(__file__).resolve().parents[2]
DATA = ROOT / "engine" / "tests" / "data" / "chat_templates"
NOW = dt.datetime(2025, 3, 7, 14, 5, 9)


class FixedDatetime(dt.datetime):
    @classmethod
    def now(cls, tz=None):
        return NOW


# transformers' strftime_now calls `datetime.now()` through this module global.
ctu.datetime = FixedDatetime

# The models' own special tokens ("" where the tokenizer has none: not passed to the template).
TEMPLATES = {
    "meta-llama-Llama-3.1-8B-Instruct": ("<|begin_of_text|>", "<|eot_id|>"),
    "meta-llama-Llama-3.2-3B-Instruct": ("<|begin_of_text|>", "<|eot_id|>"),
    "Qwen-Qwen2.5-7B-Instruct": ("", "<|im_end|>"),
    "Qwen-Qwen3-0.6B": ("", "<|im_end|>"),
    "google-gemma-2-2b-it": ("<bos>", "<eos>"),
    "microsoft-Phi-3.5-mini-instruct": ("<s>", "<|endoftext|>"),
    "mistralai-Mistral-Nemo-Instruct-2407": ("<s>", "</s>"),
    "Mistral-Small-3.2-24B-Instruct-2506": ("<s>", "</s>"),
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": ("<|begin_of_text|>", "<|im_end|>"),
    "HuggingFaceTB-SmolLM3-3B": ("", "<|im_end|>"),
    "google-gemma-3-4b-it": ("<bos>", "<eos>"),
    "microsoft-Phi-4-mini-instruct": ("<|endoftext|>", "<|endoftext|>"),
}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city, in °C. Use <city> names & don't abbreviate.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name, e.g. Zürich"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                    "days": {"type": "integer", "minimum": 1, "default": 1},
                },
                "required": ["city"],
            },
        },
    }
]

HISTORY = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3+3? Answer in one word."},
]

# Mistral templates want 9-character alphanumeric call ids.
CALL = {
    "id": "abc123XYZ",
    "type": "function",
    "function": {
        "name": "get_weather",
        "arguments": {"city": "Paris", "days": 2, "precise": True, "threshold": 0.5, "tags": []},
    },
}

CASES = {
    "user_generation_prompt": ([{"role": "user", "content": "Hello! Who are you?"}], None, True),
    "system_history_generation_prompt": (HISTORY, None, True),
    "system_history_no_generation_prompt": (HISTORY, None, False),
    "tools": ([{"role": "user", "content": "What's the weather in Paris?"}], TOOLS, True),
    "tool_call_round_trip": (
        [
            {"role": "user", "content": "What's the weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "abc123XYZ", "content": '{"temperature": 18, "sky": "clear"}'},
        ],
        TOOLS,
        True,
    ),
    # A thinking model's tool loop: the assistant turn carries its reasoning back
    # (`reasoning_content`, which Qwen3's template renders after the last user turn).
    "reasoning_round_trip": (
        [
            {"role": "user", "content": "What's the weather in Paris?"},
            {"role": "assistant", "content": "", "reasoning_content": "I need the weather tool.", "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "abc123XYZ", "content": '{"temperature": 18, "sky": "clear"}'},
        ],
        TOOLS,
        True,
    ),
    # Phi-4-mini's convention (its model card): the tools as json.dumps text in the system
    # message's own `tools` field; templates that do not read the field ignore it.
    "system_message_tools": (
        [
            {
                "role": "system",
                "content": "You are a helpful assistant with some tools.",
                "tools": json.dumps([TOOLS[0]["function"]]),
            },
            {"role": "user", "content": "What's the weather in Paris?"},
        ],
        None,
        True,
    ),
}

# Template arguments (`chat_template_kwargs`), passed as apply_chat_template(**kwargs) passes them.
KWARGS_CASES = {
    "thinking_off": (HISTORY, None, True, {"enable_thinking": False}),
    "thinking_on": (HISTORY, None, True, {"enable_thinking": True}),
}


def render(source, bos, eos, messages, tools, add_generation_prompt, kwargs=None):
    special = {k: v for k, v in (("bos_token", bos), ("eos_token", eos)) if v}
    rendered, _ = ctu.render_jinja_template(
        conversations=[json.loads(json.dumps(messages))],
        tools=tools,
        chat_template=source,
        add_generation_prompt=add_generation_prompt,
        **special,
        **(kwargs or {}),
    )
    return rendered[0]


def reads_tools(source):
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    return "tools" in jinja2.meta.find_undeclared_variables(env.parse(source))


def renders_system_tools(source, bos, eos):
    """Whether a system message's own `tools` field reaches the prompt (Phi-4-mini's convention)."""
    probe = "\u0001pd-system-tools-probe\u0001"
    messages = [{"role": "system", "content": "", "tools": probe}, {"role": "user", "content": "x"}]
    try:
        return probe in render(source, bos, eos, messages, None, True)
    except Exception:  # noqa: BLE001 - a template that refuses the probe does not render the field
        return False


def main():
    out = {
        "transformers": transformers.__version__,
        "now_utc_seconds": calendar.timegm(NOW.timetuple()),
        "templates": {},
    }
    for name, (bos, eos) in TEMPLATES.items():
        source = (DATA / f"{name}.jinja").read_text()
        cases = {}
        cases_here = {**{k: (*v, None) for k, v in CASES.items()}, **KWARGS_CASES}
        for case, (messages, tools, agp, kwargs) in cases_here.items():
            entry = {"messages": messages, "tools": tools, "add_generation_prompt": agp}
            if kwargs:
                entry["kwargs"] = kwargs
            try:
                entry["text"] = render(source, bos, eos, messages, tools, agp, kwargs)
            except Exception as e:  # noqa: BLE001 - the template's own error is the expected result
                entry["error"] = str(e)
                entry["error_type"] = type(e).__name__
                if tools is None and isinstance(e, TypeError):
                    # A tool-use template iterating `tools` when there are none: Python raises,
                    # minijinja iterates None as empty. What pd renders instead is this.
                    entry["text_with_empty_tools"] = render(source, bos, eos, messages, [], agp)
            cases[case] = entry
        out["templates"][name] = {
            "bos": bos,
            "eos": eos,
            "reads_tools": reads_tools(source),
            "renders_system_tools": renders_system_tools(source, bos, eos),
            "cases": cases,
        }
        print(name, {c: ("error" if "error" in e else len(e["text"])) for c, e in cases.items()})
    (DATA / "expected.json").write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
