"""A broken environment as an OpenEnv environment."""
