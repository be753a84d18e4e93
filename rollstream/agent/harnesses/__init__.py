"""Harnesses rollstream ships (see rollstream.agent.harness): each is a plain OpenAI-API agent
that knows nothing of rollstream beyond the URL, key and tools its context gives it."""
