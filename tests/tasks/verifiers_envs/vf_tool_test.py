"""tool-test (tool environment), as verifiers' environments/tool_test: call exactly the tools the
prompt lists; the reward is 1 when the last reply's tool calls name exactly those tools."""

import verifiers as vf
from datasets import Dataset


async def tool_A(x: int) -> int:
    """
    Tool for adding 1 to an integer.

    Args:
        x: The integer to add 1 to.

    Returns:
        The integer plus 1.
    """
    return x + 1


async def tool_B(x: str) -> str:
    """
    Tool for concatenating a string with "2".

    Args:
        x: The string to concatenate with "2".

    Returns:
        The string concatenated with "2".
    """
    return x + "2"


TOOLS = [tool_A, tool_B]
ROWS = [["tool_A"], ["tool_B"], ["tool_A", "tool_B"]]


def tool_call_reward_func(completion: vf.Messages, info: dict) -> float:
    tool_calls = (completion[-1].tool_calls or []) if completion[-1].role == "assistant" else []
    return 1.0 if sorted(call.name for call in tool_calls) == sorted(info["tool_names"]) else 0.0


def load_environment() -> vf.ToolEnv:
    def build_dataset() -> Dataset:
        return Dataset.from_list([
            {"prompt": [{"role": "user",
                         "content": f"Call the following tools with arguments of your choice: {names}"}],
             "info": {"tool_names": names}}
            for names in ROWS])

    return vf.ToolEnv(dataset=build_dataset, rubric=vf.Rubric(funcs=[tool_call_reward_func]), tools=TOOLS, max_turns=1)
