#!/usr/bin/env python
"""Rebuilds the shipped real SWE instances (rollstream/data/swe/pypi_instances.jsonl and the
repository bundles beside it) from public projects' consecutive releases on PyPI.

For each project: the sdists of two consecutive versions become two commits; the changed
source is the gold ``patch``, the changed tests the ``test_patch``; the environment recipe
is built into an image (rollstream's env_images) and the test files of the test_patch run
there, with plain pytest and its ``-rA`` summary (as the SWE-bench harness parses it), at
base + test_patch and at base + patch + test_patch: FAIL_TO_PASS failed then passed,
PASS_TO_PASS passed both times. Needs network (PyPI), git and a container engine.

    .venv/bin/python scripts/build_swe_pypi_instances.py [--only six,parse]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from rollstream.sandboxes.env_images import docker
from rollstream.tasks import swe_env, swe_records
from rollstream.tasks.swe_repos import SHIPPED_BUNDLES

OUT = Path(__file__).resolve().parent.parent / "rollstream" / "data" / "swe" / "pypi_instances.jsonl"
GIT_ENV = {
    "GIT_AUTHOR_NAME": "rollstream", "GIT_AUTHOR_EMAIL": "rollstream@example.invalid",
    "GIT_COMMITTER_NAME": "rollstream", "GIT_COMMITTER_EMAIL": "rollstream@example.invalid",
    "GIT_AUTHOR_DATE": "2024-01-01T00:00:00+0000", "GIT_COMMITTER_DATE": "2024-01-01T00:00:00+0000",
    "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull, "TZ": "UTC",
}
# The swe task's idea of a test file (it never takes these from the agent's diff).
TEST_GLOBS = ["**/tests/**", "**/test/**", "**/test_*.py", "**/*_test.py", "**/conftest.py"]
CHANGELOG = re.compile(r"^(CHANGES|CHANGELOG|HISTORY|NEWS)(\.\w+)?$|versions\.rst$", re.IGNORECASE)


@dataclass
class Project:
    name: str  # the PyPI name
    old: str
    new: str
    pip_packages: list[str] = field(default_factory=lambda: ["pytest==8.3.3"])
    why: str = ""  # what the project brings to the set


PROJECTS = [
    Project("parse", "1.20.0", "1.20.1"),
    Project("idna", "3.7", "3.8", why="flit build backend"),
    Project("more-itertools", "10.4.0", "10.5.0", why="flit build backend"),
    Project("cachetools", "5.4.0", "5.5.0", why="src layout"),
    Project("toolz", "0.12.0", "0.12.1", why="tests inside the package"),
    Project("semver", "3.0.1", "3.0.2", ["pytest==8.3.3", "pytest-cov==5.0.0"],
            why="setup.cfg passes --cov and sets pythonpath, src layout"),
    Project("packaging", "24.0", "24.1", ["pytest==8.3.3", "pretend==1.0.9"], why="a test dependency (pretend)"),
    Project("wcwidth", "0.2.12", "0.2.13", ["pytest==8.3.3", "pytest-cov==5.0.0"],
            why="tox.ini passes --cov: needs the pytest-cov plugin autoloaded"),
    Project("async-timeout", "4.0.2", "4.0.3", ["pytest==7.4.4", "pytest-asyncio==0.21.2", "pytest-cov==4.1.0"],
            why="setup.cfg passes --cov, async tests need pytest-asyncio"),
    Project("blinker", "1.7.0", "1.8.0", ["pytest==8.1.2", "pytest-asyncio==0.23.6"],
            why="asyncio_mode=auto (pytest-asyncio), tests added and deleted"),
    Project("decorator", "5.1.0", "5.1.1", why="src/tests inside a src layout"),
    Project("jmespath", "1.0.0", "1.0.1", ["pytest==8.3.3"], why="the release adds the whole test suite"),
    Project("pathspec", "0.12.0", "0.12.1"),
    Project("sqlparse", "0.5.0", "0.5.1", why="hatchling build backend"),
    Project("tomlkit", "0.13.0", "0.13.2", why="poetry-core build backend"),
]
# Tried and left out: six 1.16.0 -> 1.17.0, more-itertools 10.4.0 -> 10.5.0, toolz 0.12.0 -> 0.12.1
# and decorator 5.1.0 -> 5.1.1 change no test from failing to passing on 3.11; markdown 3.6 -> 3.7's
# test run did not finish in minutes.


def git(*args: str, cwd: Path) -> str:
    result = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, env={**os.environ, **GIT_ENV})
    if result.returncode != 0:
        raise RuntimeError(f"git {' '.join(args[:3])}: {result.stderr[-800:]}")
    return result.stdout


def sdist(project: Project, version: str, cache: Path) -> Path:
    name = "[-_.]".join(re.escape(part) for part in re.split(r"[-_.]", project.name))
    pattern = re.compile(rf"{name}-{re.escape(version)}\.tar\.gz", re.IGNORECASE)
    for attempt in range(2):
        found = [p for p in cache.glob("*.tar.gz") if pattern.fullmatch(p.name)]
        if found:
            return found[0]
        if attempt == 0:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                            "-d", str(cache), f"{project.name}=={version}"], check=True)
    raise RuntimeError(f"pip download of {project.name}=={version} left no sdist in {cache}")


def unpack(archive: Path, destination: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(archive) as handle:
            handle.extractall(tmp, filter="data")
        (top,) = os.listdir(tmp)
        for entry in os.listdir(destination):
            if entry != ".git":
                path = destination / entry
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        for entry in os.listdir(os.path.join(tmp, top)):
            if not entry.endswith(".egg-info"):  # build debris the sdist carries
                shutil.move(os.path.join(tmp, top, entry), destination / entry)
    for path in destination.rglob("*"):
        if ".git" not in path.parts:
            path.chmod(0o755 if path.is_dir() else 0o644)


def problem_statement(project: Project, repo: Path, old: str, new: str) -> str:
    notes = ""
    for path in git("diff", "--name-only", old, new, cwd=repo).split():
        if CHANGELOG.search(os.path.basename(path)) or CHANGELOG.search(path):
            added = [line[1:] for line in git("diff", "-U0", old, new, "--", path, cwd=repo).splitlines()
                     if line.startswith("+") and not line.startswith("+++")]
            notes = "\n".join(added).strip()[:1500]
            break
    text = (f"Prepare release {project.new} of {project.name} (the repository holds {project.old}). "
            "Make the source changes of that release; hidden tests check them.")
    return text + (f"\n\nRelease notes:\n{notes}" if notes else "")


def pytest_outcomes(tag: str, repo_dir: str, checkout: Path, tests: list[str]) -> dict[str, str]:
    """Run `tests` in the environment image with plain pytest; outcomes from its -rA summary."""
    run = docker("run", "--rm", "--network", "none", "--volume", f"{checkout}:{repo_dir}", "--workdir", repo_dir,
                 tag, "python", "-m", "pytest", "-rA", "--color=no", "--continue-on-collection-errors",
                 "-p", "no:cacheprovider", *tests, check=False, timeout=900)
    outcomes: dict[str, str] = {}
    for line in run.stdout.splitlines():
        match = re.match(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (\S+)(?: - .*)?$", line)
        if match and "::" in match.group(2):
            status, test = match.groups()
            outcomes[test] = "passed" if status == "PASSED" else status.lower()
    if not outcomes:
        raise RuntimeError(f"no test outcomes in the pytest run of {tests}: {run.stdout[-2000:]}{run.stderr[-2000:]}")
    return outcomes


def build(project: Project, cache: Path, mirror: Path, work: Path) -> dict | None:
    name = re.sub(r"[^a-z0-9]+", "_", project.name.lower())
    repo = work / name
    repo.mkdir()
    git("init", "-q", "-b", "main", cwd=repo)
    commits = []
    for version in (project.old, project.new):
        unpack(sdist(project, version, cache), repo)
        git("add", "-A", cwd=repo)
        git("-c", "commit.gpgsign=false", "commit", "-q", "--allow-empty", "-m", f"{project.name} {version}", cwd=repo)
        commits.append(git("rev-parse", "HEAD", cwd=repo).strip())
    old, new = commits
    test_patch = git("diff", "--binary", old, new, "--", *[f":(glob){g}" for g in TEST_GLOBS], cwd=repo)
    # Binary files (docs' object inventories) stay out of the gold patch: no test reads them.
    binary = [line.split("\t", 2)[2] for line in git("diff", "--numstat", old, new, cwd=repo).splitlines()
              if line.startswith("-\t-\t")]
    patch = git("diff", old, new, "--", ".", *[f":(exclude,glob){g}" for g in TEST_GLOBS],
                *[f":(exclude,literal){path}" for path in binary], cwd=repo)
    if not test_patch or not patch:
        print(f"{project.name}: the release changes no {'tests' if not test_patch else 'source'}; skipped")
        return None
    # Ship the old release only: a bundle with the new one would hand the agent the answer.
    bundle = SHIPPED_BUNDLES / f"pypi__{name}.bundle"
    bundle.parent.mkdir(parents=True, exist_ok=True)
    git("branch", "-q", "-f", "base", old, cwd=repo)
    git("bundle", "create", str(bundle), "base", cwd=repo)
    instance = {
        "instance_id": f"pypi__{name}-{project.new}",
        "repo": f"pypi/{name}",
        "base_commit": old,
        "problem_statement": problem_statement(project, repo, old, new),
        "patch": patch,
        "test_patch": test_patch,
        "version": project.old,
        "created_at": "2024-01-01T00:00:00Z",
        "environment": {"python": "3.11", "pip_packages": project.pip_packages,
                        "install": "python -m pip install -q --no-deps -e ."},
        "eval_timeout_s": 180,
    }
    inst = swe_records.normalize(instance)
    (built,) = swe_env.build_for_instances([instance], mirror, ("docker",))
    recipe = swe_env.env_recipe(inst)
    touched = sorted({p for p in re.findall(r"^\+\+\+ b/(\S+)", test_patch, re.MULTILINE) if p.endswith(".py")
                      and "conftest" not in p})
    runs = {}
    for label, applied in (("before", [test_patch]), ("after", [patch, test_patch])):
        checkout = work / f"{name}-{label}"
        git("clone", "-q", str(repo), str(checkout), cwd=work)
        git("checkout", "-q", "--detach", old, cwd=checkout)
        for number, diff in enumerate(applied):
            (checkout / f".rs-{number}.patch").write_text(diff)
            git("apply", f".rs-{number}.patch", cwd=checkout)
            (checkout / f".rs-{number}.patch").unlink()
        runs[label] = pytest_outcomes(built["tag"], recipe.repo_dir, checkout, touched)
    before, after = runs["before"], runs["after"]
    clean = [t for t in after if " " not in t]
    instance["FAIL_TO_PASS"] = sorted(t for t in clean if after[t] == "passed" and before.get(t) != "passed")
    instance["PASS_TO_PASS"] = sorted(t for t in clean if after[t] == "passed" and before.get(t) == "passed")
    if not instance["FAIL_TO_PASS"]:
        print(f"{project.name}: no test fails before and passes after; skipped")
        bundle.unlink()
        return None
    print(f"{project.name}: FAIL_TO_PASS {len(instance['FAIL_TO_PASS'])}, PASS_TO_PASS {len(instance['PASS_TO_PASS'])}")
    return instance


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated project names (default: all)")
    parser.add_argument("--cache", default=os.path.expanduser("~/.cache/rollstream/sdists"))
    args = parser.parse_args()
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    wanted = {n for n in args.only.split(",") if n}
    made = []
    with tempfile.TemporaryDirectory(prefix="rs-pypi-") as tmp:
        for project in PROJECTS:
            if wanted and project.name not in wanted:
                continue
            work = Path(tmp) / project.name
            work.mkdir()
            try:
                instance = build(project, cache, Path(tmp) / "mirror", work)
            except Exception as error:  # one project's failure leaves the others' instances
                print(f"{project.name}: failed: {str(error)[-1500:]}")
                continue
            if instance is not None:
                made.append(instance)
    existing = {}
    if OUT.exists():  # instances not rebuilt this time are kept
        existing = {json.loads(line)["instance_id"]: json.loads(line) for line in OUT.read_text().splitlines() if line}
    merged = {**existing, **{i["instance_id"]: i for i in made}}
    order = [f"pypi__{re.sub(r'[^a-z0-9]+', '_', p.name.lower())}-{p.new}" for p in PROJECTS]
    lines = [json.dumps(merged[i], sort_keys=True) for i in order if i in merged]
    OUT.write_text("\n".join(lines) + "\n")
    print(f"wrote {len(lines)} instances to {OUT}")


if __name__ == "__main__":
    main()
