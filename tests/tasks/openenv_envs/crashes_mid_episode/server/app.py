"""A broken environment: its server process dies on the episode's second step, as one with a
native crash (a segfault in an extension) would."""

import os
import sys

from models import CrashAction, CrashObservation
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import State


class CrashEnvironment(Environment):
    def __init__(self):
        self._state = State(step_count=0)

    def reset(self, seed=None, episode_id=None, **kwargs) -> CrashObservation:
        self._state = State(step_count=0)
        return CrashObservation(message="ready", done=False, reward=0.0)

    def step(self, action: CrashAction) -> CrashObservation:  # type: ignore[override]
        self._state.step_count += 1
        if self._state.step_count >= 2:
            print("fatal: the simulator's native extension crashed (step 2)", file=sys.stderr, flush=True)
            os._exit(139)
        return CrashObservation(message=f"step {self._state.step_count}", done=False, reward=0.0)

    @property
    def state(self) -> State:
        return self._state


app = create_app(CrashEnvironment, CrashAction, CrashObservation, env_name="crashes_mid_episode")
