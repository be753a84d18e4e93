"""The built-in server's name for rollstream/llm/detokenizer.py (which the door uses too, without
importing the server and its torch engine)."""

from rollstream.llm.detokenizer import IncrementalText

__all__ = ["IncrementalText"]
