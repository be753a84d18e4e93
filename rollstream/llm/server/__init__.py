"""The built-in inference server: transformers on CPU or CUDA behind vLLM's completions API,
so that rollstream runs end to end without vLLM. engine.py steps the model, cache.py keeps
prefix keys/values, sampling.py picks tokens, app.py serves HTTP."""

from rollstream.llm.server.app import create_app, free_port, serve_model, served_model, start_server_process

__all__ = ["create_app", "free_port", "serve_model", "served_model", "start_server_process"]
