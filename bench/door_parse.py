"""What parsing a request into its API's typed model (rollstream/agent/door_models.py) adds to the
door's checks of it, per API, on an 8-turn agent conversation with a tool; and the two ways pydantic
could parse a chat request: ``model_validate`` on the dict the checks already read, or
``model_validate_json`` on the body (which parses the JSON a second time).

Times are this thread's CPU time (so other processes on a loaded machine do not count), the
minimum of --repeats runs of --number calls.

Run: python bench/door_parse.py [--number 5000] [--repeats 15]
Last line: RESULT {"added_us_chat", "added_us_responses", "added_us_anthropic", "checks_us_<api>",
"model_validate_us", "model_validate_json_us", "json_loads_us"}.
"""

from __future__ import annotations

import argparse
import json
import time
import timeit

from rollstream.agent.door_anthropic import AnthropicApi
from rollstream.agent.door_anthropic import parse as anthropic_checks
from rollstream.agent.door_chat import ChatApi
from rollstream.agent.door_models import ChatRequest
from rollstream.agent.door_request import parse_request
from rollstream.agent.door_responses import ResponsesApi
from rollstream.agent.door_responses import parse as responses_checks

TURNS = 8
SYSTEM, TASK = "You are a careful agent. " * 20, "Compute 2+3 with the shell. " * 10


def _chat() -> dict:
    messages: list[dict] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
    for i in range(TURNS):
        messages += [{"role": "assistant", "content": "", "tool_calls": [{"id": f"call_{i}", "type": "function",
                      "function": {"name": "bash", "arguments": '{"command": "echo $((2+3))"}'}}]},
                     {"role": "tool", "tool_call_id": f"call_{i}", "content": "5\n"}]
    tools = [{"type": "function", "function": {"name": "bash", "description": "run a command",
                                               "parameters": {"type": "object"}}}]
    return {"model": "m", "messages": messages, "tools": tools, "temperature": 0.7, "max_tokens": 256}


def _responses() -> dict:
    items: list[dict] = [{"type": "message", "role": "user", "content": TASK}]
    for i in range(TURNS):
        items += [{"type": "function_call", "call_id": f"c{i}", "name": "bash", "arguments": '{"command": "ls"}'},
                  {"type": "function_call_output", "call_id": f"c{i}", "output": "5\n"}]
    return {"model": "m", "instructions": SYSTEM, "input": items, "store": False,
            "tools": [{"type": "function", "name": "bash", "parameters": {"type": "object"}}]}


def _anthropic() -> dict:
    messages: list[dict] = [{"role": "user", "content": TASK}]
    for i in range(TURNS):
        messages += [{"role": "assistant", "content": [{"type": "tool_use", "id": f"t{i}", "name": "bash",
                                                        "input": {"command": "ls"}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"t{i}", "content": "5\n"}]}]
    return {"model": "m", "max_tokens": 256, "system": SYSTEM, "messages": messages,
            "tools": [{"name": "bash", "input_schema": {"type": "object"}}]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--number", type=int, default=5000, help="calls per timed run")
    ap.add_argument("--repeats", type=int, default=15, help="timed runs; the minimum is reported")
    args = ap.parse_args()

    def cpu_us(call) -> float:
        runs = timeit.repeat(call, number=args.number, repeat=args.repeats, timer=time.thread_time)
        return min(runs) / args.number * 1e6

    chat, responses, anthropic = _chat(), _responses(), _anthropic()
    rows = [("chat", lambda: parse_request(chat), lambda: ChatApi().parse(chat)),
            ("responses", lambda: responses_checks(responses), lambda: ResponsesApi().parse(responses)),
            ("anthropic", lambda: anthropic_checks(anthropic), lambda: AnthropicApi().parse(anthropic))]
    result: dict[str, float] = {}
    print(f"{'API':10s} {'checks':>8s} {'checks + model':>15s} {'added':>7s}   (us of CPU per call)")
    for name, checks, typed in rows:
        before, after = cpu_us(checks), cpu_us(typed)
        result[f"checks_us_{name}"], result[f"added_us_{name}"] = round(before, 2), round(after - before, 2)
        print(f"{name:10s} {before:8.2f} {after:15.2f} {after - before:7.2f}")
    body = json.dumps(chat).encode()
    result["model_validate_us"] = round(cpu_us(lambda: ChatRequest.model_validate(chat)), 2)
    result["model_validate_json_us"] = round(cpu_us(lambda: ChatRequest.model_validate_json(body)), 2)
    result["json_loads_us"] = round(cpu_us(lambda: json.loads(body)), 2)
    print(f"chat request: model_validate(dict) {result['model_validate_us']} us, model_validate_json(body) "
          f"{result['model_validate_json_us']} us (json.loads alone {result['json_loads_us']} us, which the checks "
          "need anyway)")
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
