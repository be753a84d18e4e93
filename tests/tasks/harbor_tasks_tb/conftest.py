"""The task folders here are Harbor tasks whose tests/test_outputs.py run inside a task sandbox
(/tests), never in this suite."""

collect_ignore_glob = ["*"]
