"""The game: a secret word picked by the reset's seed, six guesses, reward 1.0 on finding it."""

from uuid import uuid4

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import State

try:
    from ..models import WordGuessAction, WordGuessObservation
except ImportError:
    from models import WordGuessAction, WordGuessObservation

WORDS = ["planet", "rocket", "garden", "silver", "bridge", "candle"]
MAX_TRIES = 6


def feedback(guess: str, secret: str) -> str:
    return "".join("G" if g == s else "Y" if g in secret else "." for g, s in zip(guess, secret))


class WordGuessEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS: bool = True

    def __init__(self):
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self._secret = WORDS[0]
        self._tries_left = MAX_TRIES

    def reset(self, seed=None, episode_id=None, **kwargs) -> WordGuessObservation:
        self._secret = WORDS[(seed or 0) % len(WORDS)]
        self._tries_left = MAX_TRIES
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return WordGuessObservation(word_length=len(self._secret), tries_left=self._tries_left, done=False,
                                    reward=0.0, message=f"Guess the {len(self._secret)}-letter word.")

    def step(self, action: WordGuessAction) -> WordGuessObservation:  # type: ignore[override]
        self._state.step_count += 1
        guess = action.guess.strip().lower()
        if len(guess) != len(self._secret):
            return WordGuessObservation(word_length=len(self._secret), tries_left=self._tries_left, done=False,
                                        reward=0.0, message=f"A guess has {len(self._secret)} letters.")
        self._tries_left -= 1
        found = guess == self._secret
        done = found or self._tries_left == 0
        return WordGuessObservation(word_length=len(self._secret), feedback=feedback(guess, self._secret),
                                    tries_left=self._tries_left, done=done, reward=1.0 if found else 0.0,
                                    message="Found it." if found else "Not it." if not done else "Out of tries.")

    @property
    def state(self) -> State:
        return self._state
