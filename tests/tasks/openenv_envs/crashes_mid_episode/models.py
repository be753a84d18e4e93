"""The broken environment's action and observation."""

from openenv.core.env_server.types import Action, Observation
from pydantic import Field


class CrashAction(Action):
    text: str = Field(..., description="Anything")


class CrashObservation(Observation):
    message: str = Field(default="")
