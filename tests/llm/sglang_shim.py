"""A small real HTTP server that answers SGLang's native /generate shape, backed by the
built-in engine: stands in for SGLang (not installable on this CPU machine) so that the
SGLang adapter's request/response mapping is tested against real generations.

Shape served (SGLang's GenerateReqInput / meta_info, single prompt):
  request  {"input_ids": [...], "sampling_params": {"max_new_tokens", "temperature", "top_p",
            "top_k", "min_p", "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens",
            "no_stop_trim", ...}, "return_logprob": true}
  response {"text", "output_ids", "meta_info": {"id", "finish_reason": {"type": "stop",
            "matched": id|str} | {"type": "length", "length": n}, "prompt_tokens",
            "completion_tokens", "cached_tokens", "output_token_logprobs": [[lp, id, null]],
            "weight_version"}}"""

from __future__ import annotations

import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from rollstream.llm.server import free_port
from rollstream.llm.server.engine import Engine, GenerateRequest
from rollstream.llm.server.sampling import SequenceSampling


def make_app(engine: Engine, received: list[dict]) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health():
        return {}

    @app.post("/generate")
    async def generate(request: Request):
        body = await request.json()
        received.append(body)
        sp = body.get("sampling_params", {})
        if sp.get("abort_me"):
            return {"text": "", "meta_info": {"finish_reason": {"type": "abort", "message": "scheduler aborted"},
                                              "output_token_logprobs": []}}
        sampling = SequenceSampling(
            temperature=sp.get("temperature", 1.0), top_p=sp.get("top_p", 1.0), top_k=sp.get("top_k", -1),
            min_p=sp.get("min_p", 0.0), min_tokens=sp.get("min_new_tokens", 0), seed=sp.get("sampling_seed"),
        )
        sampling.make_generator(engine.device)
        req = GenerateRequest(
            prompt_ids=body["input_ids"], max_tokens=sp.get("max_new_tokens", 128), sampling=sampling,
            stop=[sp["stop"]] if isinstance(sp.get("stop"), str) else list(sp.get("stop") or []),
            stop_token_ids=list(sp.get("stop_token_ids") or []), ignore_eos=sp.get("ignore_eos", False),
            skip_special_tokens=sp.get("skip_special_tokens", True),
            include_stop_str_in_output=sp.get("no_stop_trim", False),
        )
        out = await engine.generate(req)
        if out.finish_reason == "length":
            finish = {"type": "length", "length": len(out.token_ids)}
        else:
            finish = {"type": "stop", "matched": out.stop_reason if out.stop_reason is not None else out.token_ids[-1]}
        meta = {
            "id": f"sg-{time.time_ns()}",
            "finish_reason": finish,
            "prompt_tokens": out.prompt_tokens,
            "completion_tokens": len(out.token_ids),
            "cached_tokens": out.cached_tokens,
            "weight_version": str(out.policy_version),
        }
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(out.logprobs, out.token_ids)]
        return JSONResponse({"text": out.text, "output_ids": out.token_ids, "meta_info": meta})

    return app


class SGLangShim:
    """Runs the shim with uvicorn on a background thread; `base_url`, `received` bodies."""

    def __init__(self, engine: Engine):
        self.received: list[dict] = []
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(make_app(engine, self.received), host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.engine = engine
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> SGLangShim:
        self.engine.start()
        self.thread.start()
        for _ in range(200):
            if self.server.started:
                return self
            time.sleep(0.05)
        raise RuntimeError("SGLang shim did not start")

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.engine.shutdown()
