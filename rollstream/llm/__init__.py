"""LLM side of the run stage: token-in/token-out clients for vLLM / SGLang / the built-in
server, the built-in transformers server itself (`rollstream.llm.server`), and a tiny local
model for CPU runs and tests. Importing this package does not import torch."""

from rollstream.llm.inference_client import (
    BackendError,
    CompletionBackend,
    ContextLengthError,
    Generation,
    SamplingParams,
    SGLangClient,
    VLLMClient,
    make_client,
)
from rollstream.llm.tiny_model import build_tiny_model

__all__ = [
    "BackendError",
    "CompletionBackend",
    "ContextLengthError",
    "Generation",
    "SamplingParams",
    "SGLangClient",
    "VLLMClient",
    "build_tiny_model",
    "make_client",
]
