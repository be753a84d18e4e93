"""Tests against a real, unmodified vLLM server. Not named `vllm`: tests/ is on sys.path, and a
folder of that name passes for the vllm package, which breaks TRL's import-time version check."""
