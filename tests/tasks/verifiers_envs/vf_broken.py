"""Environments that fail, as a buggy package would: ``load_environment(fail="load")`` raises
while loading; ``fail="rubric"`` loads a single-turn environment whose reward function raises;
``fail="turn"`` a multi-turn environment whose env_response raises; ``fail="sampling"`` one whose
sampling arguments (a logit bias) the job's door does not serve."""

import verifiers as vf
from datasets import Dataset


def load_environment(fail: str = "load") -> vf.Environment:
    if fail == "load":
        raise RuntimeError("vf-broken cannot find its dataset")

    def exploding_reward(completion, answer, **kwargs) -> float:
        raise KeyError("exploding_reward looked for a field the state lacks")

    if fail == "turn":
        class ExplodingTurns(vf.MultiTurnEnv):
            async def env_response(self, messages: vf.Messages, state: vf.State, **kwargs) -> vf.Messages:
                raise ValueError("env_response has no follow-up for this row")

        return ExplodingTurns(dataset=lambda: Dataset.from_list([{"question": "Say hi.", "answer": "hi"}]),
                              rubric=vf.Rubric(funcs=[lambda completion, answer: 0.0]), max_turns=3)

    if fail == "sampling":
        return vf.SingleTurnEnv(dataset=lambda: Dataset.from_list([{"question": "Say hi.", "answer": "hi"}]),
                                rubric=vf.Rubric(funcs=[lambda completion, answer: 1.0]),
                                sampling_args={"logit_bias": {"1": 5}})
    return vf.SingleTurnEnv(dataset=lambda: Dataset.from_list([{"question": "Say hi.", "answer": "hi"}]),
                            rubric=vf.Rubric(funcs=[exploding_reward]))
