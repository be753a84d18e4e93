import subprocess
from pathlib import Path


def git(*args):
    return subprocess.run(["git", "-C", "/app/repo", *args], capture_output=True, text=True, check=True).stdout


def test_policy_file_is_back():
    assert Path("/app/repo/policy.txt").read_text() == "deploy key rotation: every 90 days\nowner: platform team\n"


def test_main_points_at_the_lost_commit():
    assert git("log", "-1", "--format=%s", "main").strip() == "add the rotation policy"
