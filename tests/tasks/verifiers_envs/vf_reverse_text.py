"""reverse-text (single turn), as verifiers' environments/reverse_text: reverse the text and put it
in <reversed_text> tags; the reward is the LCS ratio of the parsed answer and the reversal."""

from difflib import SequenceMatcher

import verifiers as vf
from datasets import Dataset

TEXTS = ["hello world", "rollstream", "abc def"]
SYSTEM_PROMPT = "Reverse the text character-by-character. Put your answer in <reversed_text> tags."


def load_environment(system_prompt: str | None = SYSTEM_PROMPT, texts: list[str] | None = None) -> vf.Environment:
    def build_dataset() -> Dataset:
        return Dataset.from_list([{"question": t, "answer": t[::-1], "info": {}} for t in texts or TEXTS])

    parser = vf.XMLParser(["reversed_text"], answer_field="reversed_text")

    def lcs_reward_func(completion, answer, **kwargs) -> float:
        response = parser.parse_answer(completion) or ""
        return SequenceMatcher(None, response, answer).ratio()

    rubric = vf.Rubric(funcs=[lcs_reward_func], weights=[1.0])
    return vf.SingleTurnEnv(dataset=build_dataset, system_prompt=system_prompt, parser=parser, rubric=rubric)
