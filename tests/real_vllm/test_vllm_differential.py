"""The built-in server against real vLLM, request for request: the same bodies (token-id and
text prompts, logprobs, stop strings and ids, EOS, n, seeds, streaming, batched prompts,
prompts too long for the context, bad parameters) to both, on the same weights and context
length; ids, logprobs (1e-4, fp32), texts, finish and stop reasons, usage and error status
codes must agree. What is left different is listed in the README (built-in server vs vLLM)."""

from __future__ import annotations

import json

import httpx
import pytest

from rollstream.tasks import arith

from .refs import max_abs_diff, recompute_logprobs
from .test_vllm_rollouts import renderer
from .vllm_process import MAX_MODEL_LEN

LOGPROB_TOLERANCE = 1e-4
SHORT = [5, 17, 42, 99, 7]
# With the arith model, greedy output from here has a byte token that completes no character
# (text '\ufffd', logprob token name ''): where vLLM's text and token names are subtle.
PARTIAL_CHARACTER = [427, 23, 1067, 1507, 74, 323]


@pytest.fixture(scope="module")
def chat(tokenizer) -> list[int]:
    return renderer(tokenizer).prompt_ids(arith.prompt({"a": 12, "op": "+", "b": 30}))


def post(url: str, body: dict | None = None, content: bytes | None = None) -> httpx.Response:
    if content is not None:
        return httpx.post(f"{url}/v1/completions", content=content, headers={"content-type": "application/json"},
                          timeout=120)
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def both(vllm_url: str, builtin_url: str, body: dict) -> tuple[dict, dict]:
    a, b = post(vllm_url, body), post(builtin_url, body)
    assert a.status_code == 200, f"vLLM: {a.text[:500]}"
    assert b.status_code == 200, f"built-in: {b.text[:500]}"
    return a.json(), b.json()


def assert_same_logprobs(a: dict | None, b: dict | None) -> None:
    assert (a is None) == (b is None)
    if a is None:
        return
    assert a["tokens"] == b["tokens"]
    assert a["text_offset"] == b["text_offset"]
    assert max_abs_diff(a["token_logprobs"], b["token_logprobs"]) < LOGPROB_TOLERANCE
    for top_a, top_b in zip(a["top_logprobs"], b["top_logprobs"]):
        assert set(top_a) == set(top_b)
        assert max_abs_diff([top_a[k] for k in top_a], [top_b[k] for k in top_a]) < LOGPROB_TOLERANCE


def assert_same_completion(vllm: dict, builtin: dict) -> None:
    assert vllm["object"] == builtin["object"] == "text_completion"
    assert len(vllm["choices"]) == len(builtin["choices"])
    for a, b in zip(vllm["choices"], builtin["choices"]):
        assert a["index"] == b["index"]
        assert a.get("token_ids") == b.get("token_ids")
        assert a.get("prompt_token_ids") == b.get("prompt_token_ids")
        assert a["text"] == b["text"]
        assert (a["finish_reason"], a["stop_reason"]) == (b["finish_reason"], b["stop_reason"])
        assert_same_logprobs(a["logprobs"], b["logprobs"])
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert vllm["usage"][key] == builtin["usage"][key], key


IDS = {"return_token_ids": True, "return_tokens_as_token_ids": True, "logprobs": 1}
# What rollstream's VLLMClient sends (see VLLMClient.request_body), and variations of it.
GREEDY_CASES = {
    "client_body": {**IDS, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stream": False, "n": 1},
    "no_logprobs": {"return_token_ids": True, "max_tokens": 8, "temperature": 0, "ignore_eos": True},
    "logprobs_0": {**IDS, "logprobs": 0, "max_tokens": 8, "temperature": 0, "ignore_eos": True},
    "top_5_logprobs": {**IDS, "logprobs": 5, "max_tokens": 8, "temperature": 0, "ignore_eos": True},
    "token_text_names": {"return_token_ids": True, "logprobs": 2, "max_tokens": 16, "temperature": 0,
                         "ignore_eos": True},
    "eos_ends_the_turn": {**IDS, "max_tokens": 200, "temperature": 0},
    "eos_kept_in_text": {**IDS, "max_tokens": 200, "temperature": 0, "skip_special_tokens": False},
    "min_tokens": {**IDS, "max_tokens": 200, "temperature": 0, "min_tokens": 40},
    "penalties": {**IDS, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "repetition_penalty": 1.3,
                  "frequency_penalty": 0.4, "presence_penalty": 0.2},
    "top_k_1_sampling_is_greedy": {**IDS, "max_tokens": 16, "temperature": 0.8, "top_k": 1, "seed": 3,
                                   "ignore_eos": True},
    "default_max_tokens": {**IDS, "temperature": 0, "ignore_eos": True},
}


@pytest.mark.parametrize("case", list(GREEDY_CASES))
def test_greedy_requests_answer_as_vllm(case, vllm_url, builtin_url, chat):
    for prompt in (chat, SHORT, PARTIAL_CHARACTER):
        assert_same_completion(*both(vllm_url, builtin_url, {"prompt": prompt, **GREEDY_CASES[case]}))


def test_stop_strings_and_stop_ids_end_turns_as_in_vllm(vllm_url, builtin_url, chat, tokenizer):
    free, _ = both(vllm_url, builtin_url, {"prompt": chat, **GREEDY_CASES["client_body"]})
    ids, text = free["choices"][0]["token_ids"], free["choices"][0]["text"]
    word = next(w for w in ("bash", "command", "echo", "name") if w in text)
    for extra in ({"stop": [word]}, {"stop": word, "include_stop_str_in_output": True},
                  {"stop": ["no such text", word]}, {"stop_token_ids": [ids[6]]},
                  {"stop_token_ids": [ids[6]], "stop": [word]}):
        vllm, builtin = both(vllm_url, builtin_url, {"prompt": chat, **GREEDY_CASES["client_body"], **extra})
        assert vllm["choices"][0]["finish_reason"] == "stop"
        assert_same_completion(vllm, builtin)


def test_batched_and_text_prompts_answer_as_vllm(vllm_url, builtin_url, chat):
    body = {**GREEDY_CASES["client_body"], "max_tokens": 8}
    assert_same_completion(*both(vllm_url, builtin_url, {**body, "prompt": [chat, SHORT, chat[:20]]}))
    assert_same_completion(*both(vllm_url, builtin_url, {**body, "prompt": "What is 2 + 2?"}))
    assert_same_completion(*both(vllm_url, builtin_url, {**body, "prompt": ["What is 2 + 2?", "hello"]}))


def test_context_limits_answer_as_vllm(vllm_url, builtin_url):
    body = {**GREEDY_CASES["client_body"], "max_tokens": 50}
    # max_tokens past the room the prompt leaves is clamped to it, silently.
    vllm, builtin = both(vllm_url, builtin_url, {**body, "prompt": [5] * (MAX_MODEL_LEN - 4)})
    assert len(vllm["choices"][0]["token_ids"]) == 4 and vllm["choices"][0]["finish_reason"] == "length"
    assert_same_completion(vllm, builtin)


def sampled_logprob_error(reference_model, prompt: list[int], choice: dict) -> float:
    return max_abs_diff(choice["logprobs"]["token_logprobs"],
                        recompute_logprobs(reference_model, prompt, choice["token_ids"]))


def test_n_samples_and_seeds_behave_as_in_vllm(vllm_url, builtin_url, chat, reference_model):
    """Seeded samples are not the same tokens (the two samplers draw differently); everything
    else is: n choices indexed 0..n-1, each the model's own logprobs, seeds reproducible, the
    prompt counted once in usage; batched prompts times n give prompt-major indices."""
    body = {**IDS, "prompt": SHORT, "max_tokens": 12, "temperature": 1.0, "ignore_eos": True, "n": 3, "seed": 7}
    vllm, builtin = both(vllm_url, builtin_url, body)
    for answer in (vllm, builtin):
        assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
        assert len({tuple(c["token_ids"]) for c in answer["choices"]}) > 1
        assert all(sampled_logprob_error(reference_model, SHORT, c) < 1e-3 for c in answer["choices"])
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert vllm["usage"][key] == builtin["usage"][key], key
    for url, first in ((vllm_url, vllm), (builtin_url, builtin)):
        again = post(url, body).json()
        assert [c["token_ids"] for c in again["choices"]] == [c["token_ids"] for c in first["choices"]]
        # Sample i of a seeded request is the request with seed + i, n = 1.
        alone = post(url, {**body, "n": 1, "seed": 8}).json()
        assert alone["choices"][0]["token_ids"] == first["choices"][1]["token_ids"]
    batch = {**body, "prompt": [chat, SHORT], "n": 2}
    vllm, builtin = both(vllm_url, builtin_url, batch)
    for answer in (vllm, builtin):
        assert [(c["index"], c["prompt_token_ids"]) for c in answer["choices"]] == [
            (0, chat), (1, chat), (2, SHORT), (3, SHORT)]
        assert answer["usage"]["prompt_tokens"] == len(chat) + len(SHORT)


def stream(url: str, body: dict) -> list[dict | str]:
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


def joined(events: list, index: int) -> dict:
    choices = [c for e in events if e != "[DONE]" for c in e["choices"] if c["index"] == index]
    out = {"text": "".join(c["text"] for c in choices), "token_ids": [t for c in choices for t in c["token_ids"]],
           "logprobs": [lp for c in choices for lp in c["logprobs"]["token_logprobs"]],
           "tokens": [t for c in choices for t in c["logprobs"]["tokens"]],
           "finish": [(c["finish_reason"], c["stop_reason"]) for c in choices if c["finish_reason"]],
           "prompt_token_ids": choices[0]["prompt_token_ids"]}
    return out


def test_streamed_completions_add_up_to_what_vllm_streams(vllm_url, builtin_url, chat):
    body = {**GREEDY_CASES["client_body"], "prompt": chat, "stream": True, "stream_options": {"include_usage": True}}
    for extra in ({}, {"stop": ["echo"]}, {"prompt": PARTIAL_CHARACTER}, {"prompt": [chat, SHORT], "max_tokens": 6}):
        vllm, builtin = stream(vllm_url, {**body, **extra}), stream(builtin_url, {**body, **extra})
        assert vllm[-1] == builtin[-1] == "[DONE]"
        assert vllm[-2]["choices"] == builtin[-2]["choices"] == []
        assert {k: vllm[-2]["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")} == {
            k: builtin[-2]["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
        for index in range(2 if isinstance(extra.get("prompt", [0])[0], list) else 1):
            a, b = joined(vllm, index), joined(builtin, index)
            assert max_abs_diff(a.pop("logprobs"), b.pop("logprobs")) < LOGPROB_TOLERANCE
            assert a == b


ERROR_CASES = {
    "prompt_longer_than_the_context": {"prompt": [5] * (MAX_MODEL_LEN + 1)},
    "prompt_filling_the_context": {"prompt": [5] * MAX_MODEL_LEN},
    "max_tokens_above_the_context": {"max_tokens": MAX_MODEL_LEN + 1},
    "max_tokens_0": {"max_tokens": 0},
    "negative_temperature": {"temperature": -1},
    "top_p_0": {"top_p": 0},
    "too_many_logprobs": {"logprobs": 21},
    "negative_logprobs": {"logprobs": -1},
    "n_0": {"n": 0},
    "n_2_greedy": {"n": 2, "temperature": 0},
    "min_tokens_above_max_tokens": {"min_tokens": 9, "max_tokens": 8},
    "empty_prompt": {"prompt": []},
    "token_id_outside_the_vocabulary": {"prompt": [10**6]},
    "unknown_model": {"model": "no-such-model"},
    "max_tokens_not_a_number": {"max_tokens": "many"},
}


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_bad_requests_get_vllms_status_codes(case, vllm_url, builtin_url):
    body = {"prompt": SHORT, "max_tokens": 4, **ERROR_CASES[case]}
    vllm, builtin = post(vllm_url, body), post(builtin_url, body)
    assert vllm.status_code >= 400, vllm.text[:300]
    assert builtin.status_code == vllm.status_code, (vllm.text[:300], builtin.text[:300])
    assert builtin.json()["error"]["message"] and vllm.json()["error"]["message"]


def test_malformed_bodies_get_vllms_status_codes(vllm_url, builtin_url):
    for content in (b"{not json", b'{"max_tokens": 3}', b"[]"):
        vllm, builtin = post(vllm_url, content=content), post(builtin_url, content=content)
        assert vllm.status_code == builtin.status_code == 400, (content, vllm.text[:200], builtin.text[:200])
