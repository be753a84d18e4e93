"""Environments that fail, as a buggy package would: ``load_environment(fail="load")`` raises
while loading; ``fail="rubric"`` loads a single-turn environment whose reward function raises."""

import verifiers as vf
from datasets import Dataset


def load_environment(fail: str = "load") -> vf.Environment:
    if fail == "load":
        raise RuntimeError("vf-broken cannot find its dataset")

    def exploding_reward(completion, answer, **kwargs) -> float:
        raise KeyError("exploding_reward looked for a field the state lacks")

    return vf.SingleTurnEnv(dataset=lambda: Dataset.from_list([{"question": "Say hi.", "answer": "hi"}]),
                            rubric=vf.Rubric(funcs=[exploding_reward]))
