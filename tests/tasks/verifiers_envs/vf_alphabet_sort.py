"""alphabet-sort (multi turn), as verifiers' environments/alphabet_sort: sort names, then sort them
again with more names added in a follow-up turn (env_response); the reward is the per-turn
similarity to the sorted lists, to the 4th power, averaged over the turns."""

import difflib
import json
import re

import verifiers as vf
from datasets import Dataset

ROWS = [
    (["Zoe", "Adam"], ["Mia"]),
    (["Liam", "Emma", "Noah"], ["Ava"]),
]


def follow_up_text(names: list[str]) -> str:
    return (f"Now sort ALL of these names alphabetically: {', '.join(names)}\n"
            "Use <combined_alphabetical_sorted> tags, one name a line.")


def first_text(names: list[str]) -> str:
    return f"Sort these names alphabetically: {', '.join(names)}\nUse <alphabetical_sorted> tags, one name a line."


def build_rows() -> list[dict]:
    rows = []
    for first, more in ROWS:
        truths = [sorted(first), sorted(first + more)]
        rows.append({"prompt": [{"role": "user", "content": first_text(first)}],
                     "answer": json.dumps(truths),
                     "info": {"follow_ups": [follow_up_text(more)], "ground_truths": truths, "num_turns": 2}})
    return rows


def load_environment(similarity_power: int = 4) -> vf.Environment:
    class SortingEnv(vf.MultiTurnEnv):
        @vf.stop
        async def max_turns_for_example(self, state: vf.State) -> bool:
            return len(state["trajectory"]) >= state["info"]["num_turns"]

        async def env_response(self, messages: vf.Messages, state: vf.State, **kwargs) -> vf.Messages:
            assistant_count = len([m for m in messages if m["role"] == "assistant"])
            return [vf.UserMessage(content=state["info"]["follow_ups"][assistant_count - 1])]

    def eval_turn(completion, turn: int, info: dict) -> float:
        replies = [m["content"] for m in completion if m["role"] == "assistant"]
        if len(replies) < turn:
            return 0.0
        tag = "alphabetical_sorted" if turn == 1 else "combined_alphabetical_sorted"
        found = re.findall(f"<{tag}>(.*?)</{tag}>", replies[turn - 1] or "", re.DOTALL)
        if not found:
            return 0.0
        predicted = "\n".join(line.strip().lower() for line in found[-1].strip().split("\n") if line.strip())
        expected = "\n".join(name.lower() for name in info["ground_truths"][turn - 1])
        return difflib.SequenceMatcher(None, predicted, expected).ratio() ** similarity_power

    def weighted_reward(completion, state, **kwargs) -> float:
        turns = state["info"]["num_turns"]
        return sum(eval_turn(completion, t, state["info"]) for t in range(1, turns + 1)) / turns

    rubric = vf.Rubric(funcs=[weighted_reward], weights=[1.0])
    return SortingEnv(dataset=lambda: Dataset.from_list(build_rows()), rubric=rubric, max_turns=3)
