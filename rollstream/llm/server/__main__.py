"""`python -m rollstream.llm.server --model DIR --port N`: the same as `rollstream serve-model`."""

import typer

from rollstream.cli.llm import serve_model_command

if __name__ == "__main__":
    typer.run(serve_model_command)
