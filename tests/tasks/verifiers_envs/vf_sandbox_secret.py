"""sandbox-secret (a SandboxEnv): set-up writes a secret into the rollout's sandbox with the
environment's own sandbox client, the model reads it with SandboxEnv's bash tool and answers in
<answer> tags; the reward is 1 for the secret. Under rollstream the sandbox is the job's.

``start_command=None``: verifiers 0.3.1's SandboxEnv passes its default start command as a string,
which every prime-sandboxes release it admits (>= 0.2.39) refuses unless ``vm=False``; leaving it
unset is how an environment package builds one at this release."""

import verifiers as vf
from datasets import Dataset

SECRETS = ["orange-42", "violet-7"]
SYSTEM_PROMPT = "Use the bash tool to read the secret in secret.txt, then answer with it in <answer> tags."


class SecretEnv(vf.SandboxEnv):
    async def setup_state(self, state: vf.State, **kwargs) -> vf.State:
        state = await super().setup_state(state, **kwargs)
        await self.sandbox_client.wait_for_creation(state["sandbox_id"])
        await self.sandbox_client.execute_command(state["sandbox_id"], f"printf %s {state['answer']} > secret.txt")
        return state


def load_environment(max_turns: int = 3) -> vf.Environment:
    parser = vf.XMLParser(["answer"], answer_field="answer")

    def secret_found(completion, answer, **kwargs) -> float:
        return 1.0 if (parser.parse_answer(completion) or "").strip() == answer else 0.0

    def build_dataset() -> Dataset:
        return Dataset.from_list([{"question": "What is the secret?", "answer": s} for s in SECRETS])

    return SecretEnv(dataset=build_dataset, system_prompt=SYSTEM_PROMPT, parser=parser, start_command=None,
                     rubric=vf.Rubric(funcs=[secret_found], parser=parser), max_turns=max_turns)
