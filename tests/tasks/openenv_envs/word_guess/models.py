"""The word-guessing game's action and observation."""

from openenv.core.env_server.types import Action, Observation
from pydantic import Field


class WordGuessAction(Action):
    """One guess of the secret word."""

    guess: str = Field(..., description="A guess of the secret word (lower-case letters)")


class WordGuessObservation(Observation):
    """What the game shows after a reset or a guess."""

    word_length: int = Field(default=0, description="Letters in the secret word")
    feedback: str = Field(default="", description="Per letter: G right place, Y elsewhere in the word, . absent")
    tries_left: int = Field(default=0, description="Guesses left before the game ends")
    message: str = Field(default="", description="What happened")
