"""A word-guessing game as an OpenEnv environment."""
