"""Token bookkeeping through the model's chat template: the prompt is tokenized once, and
each tool observation becomes exactly the tokens the template adds for it, computed as the
difference of two renderings, so the model's own tokens are never re-tokenized."""

from __future__ import annotations

from typing import Any


class ChatTemplateError(ValueError):
    """The tokenizer's chat template cannot be used for token-exact multi-turn rollouts."""


class ChatRenderer:
    """Renders messages with a Hugging Face tokenizer's chat template (tools included)."""

    def __init__(
        self,
        tokenizer: Any,
        tools: list[dict] | None = None,
        end_of_turn_token: str | None = None,
        template_kwargs: dict | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.tools = tools or None
        self.template_kwargs = dict(template_kwargs or {})
        self.end_of_turn = end_of_turn_token or tokenizer.eos_token
        if not self.end_of_turn:
            raise ChatTemplateError(
                "the tokenizer has no eos token; set AgentSettings.end_of_turn_token (e.g. '<|im_end|>')"
            )
        eot_id = tokenizer.convert_tokens_to_ids(self.end_of_turn)
        if not isinstance(eot_id, int) or eot_id == getattr(tokenizer, "unk_token_id", None):
            raise ChatTemplateError(f"end-of-turn token {self.end_of_turn!r} is not one token of this tokenizer")
        self.end_of_turn_id: int = eot_id

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        text = self.tokenizer.apply_chat_template(
            messages,
            tools=self.tools,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **self.template_kwargs,
        )
        if not isinstance(text, str):
            raise ChatTemplateError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}, not text")
        return text

    def encode(self, text: str) -> list[int]:
        # The template already wrote every special token; the tokenizer must add none.
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The episode's prompt, tokenized once, ending with the assistant generation prompt."""
        return self.encode(self.render(messages, add_generation_prompt=True))

    def observation_ids(self, history: list[dict], new_messages: list[dict], model_ended_turn: bool,
                        before: str | None = None) -> list[int]:
        """Tokens that follow the model's last generated token so that the context reads like
        render(history + new_messages, add_generation_prompt=True).

        `history` ends with the assistant message of the last turn. The delta is whatever
        the template writes after that assistant turn's end token (e.g. the newline after
        <|im_end|>), plus the end token itself when the model did not produce it (cut at
        max_tokens), plus the new messages and the next generation prompt. ``before``, when
        given, is ``render(history, add_generation_prompt=False)`` computed earlier."""
        if before is None:
            before = self.render(history, add_generation_prompt=False)
        after = self.render(history + new_messages, add_generation_prompt=True)
        if not after.startswith(before):
            raise ChatTemplateError(
                "the chat template renders the history differently once tool messages follow it; "
                "token-exact rollouts need a prefix-stable template (Qwen2.5/Qwen3/Hermes templates are)"
            )
        end = before.rfind(self.end_of_turn)
        if end < 0:
            raise ChatTemplateError(
                f"the rendered assistant turn has no end-of-turn token {self.end_of_turn!r}; "
                "set AgentSettings.end_of_turn_token to the token the template closes turns with"
            )
        # What the template writes after the assistant content that the model did not write.
        template_tail = before[end + len(self.end_of_turn) :] if model_ended_turn else before[end:]
        return self.encode(template_tail + after[len(before) :])
