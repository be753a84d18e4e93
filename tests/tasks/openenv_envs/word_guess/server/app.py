"""The game's FastAPI app, as OpenEnv serves every environment."""

from openenv.core.env_server.http_server import create_app

try:
    from ..models import WordGuessAction, WordGuessObservation
    from .word_guess_environment import WordGuessEnvironment
except ImportError:
    from models import WordGuessAction, WordGuessObservation
    from server.word_guess_environment import WordGuessEnvironment

app = create_app(WordGuessEnvironment, WordGuessAction, WordGuessObservation, env_name="word_guess",
                 max_concurrent_envs=1)
