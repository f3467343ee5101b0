"""A multi-turn tool conversation driven by `instructor` (a structured-output library users
pick, over the official `openai` client) against a running pd router.

Usage: python3 tests/clients/instructor_agent.py http://127.0.0.1:PORT
Turn 1: instructor asks for a `GetWeather` call (tool mode: a named tool_choice, enforced by
pd's constraint); the tool runs here; turn 2: the conversation with the call and its result
goes back and instructor extracts a `Report` (JSON-schema mode: response_format). Exits
non-zero on any failure.
"""

import json
import sys

import instructor
import openai
from pydantic import BaseModel, Field

BASE = sys.argv[1].rstrip("/")
raw = openai.OpenAI(base_url=BASE + "/v1", api_key="unused", max_retries=0, timeout=120)
MODEL = raw.models.list().data[0].id


class GetWeather(BaseModel):
    """Current weather in a city."""

    city: str = Field(description="The city's name")


class Report(BaseModel):
    city: str
    temperature_c: int
    summary: str = Field(max_length=80)


def weather(city: str) -> dict:
    return {"city": city, "temperature_c": 21, "sky": "sunny"}


tools_client = instructor.from_openai(raw, mode=instructor.Mode.TOOLS)
question = {"role": "user", "content": "What is the weather in Paris right now?"}
call, completion = tools_client.chat.completions.create_with_completion(
    model=MODEL, messages=[question], response_model=GetWeather, max_tokens=60, temperature=0, max_retries=0
)
assert isinstance(call, GetWeather) and call.city, call
tool_call = completion.choices[0].message.tool_calls[0]
assert completion.choices[0].finish_reason == "tool_calls", completion
print(f"ok   turn 1: instructor got a GetWeather call for {call.city!r}")

result = weather(call.city)
conversation = [
    question,
    {"role": "assistant", "content": None, "tool_calls": [tool_call.model_dump(exclude_none=True)]},
    {"role": "tool", "tool_call_id": tool_call.id, "content": json.dumps(result)},
    {"role": "user", "content": "Summarize the weather report as JSON."},
]
json_client = instructor.from_openai(raw, mode=instructor.Mode.JSON_SCHEMA)
report = json_client.chat.completions.create(
    model=MODEL, messages=conversation, response_model=Report, max_tokens=120, temperature=0, max_retries=0
)
assert isinstance(report, Report), report
print(f"ok   turn 2: instructor got a Report: {report.model_dump()}")
print("all passed")
