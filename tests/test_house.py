"""The house rules that keep the code readable as it grows (issue #23), checked on the source:
no import circles, the message vocabulary at the bottom, each stage file owning its stage, small
modules, one home for the CLI, and a wheel that ships the product without its test harness."""

from __future__ import annotations

import ast
import importlib.util
import re
import shutil
import subprocess
import sys
import zipfile
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "rollstream"
WORKERS = PACKAGE / "workers"
STAGE_FILES = {"init.py", "run.py", "eval.py"}
MAX_MODULE_LINES = 600
MAX_CONSUMER_LOOP_LINES = 400


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imported_names(path: Path) -> set[str]:
    """Every name a module imports, wherever the import statement is: at the top, inside a
    function or under ``if TYPE_CHECKING`` (a circle hidden in a function is still a circle)."""
    own = module_name(path)
    package = own if path.name == "__init__.py" else own.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            # "base.name" resolves to the submodule when name is one, else to base itself.
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


@cache
def import_graph() -> dict[str, frozenset[str]]:
    """Module → the rollstream modules it imports (a ``from package import name`` counts as an
    import of the submodule when ``name`` is one, else of the package)."""
    known = modules()
    graph = {}
    for name, path in known.items():
        deps = set()
        for imported in imported_names(path):
            while imported and imported not in known:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                deps.add(imported)
        graph[name] = frozenset(deps)
    return graph


def strongly_connected(graph: dict[str, frozenset[str]]) -> list[list[str]]:
    """Tarjan's components of more than one module, iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    for root, children_of_root in graph.items():
        if root in index:
            continue
        work = [(root, iter(sorted(children_of_root)))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return circles


def reachable(start: str) -> set[str]:
    graph, seen, todo = import_graph(), set(), [start]
    while todo:
        for dep in graph[todo.pop()]:
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def in_packages(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == package or module.startswith(package + ".") for package in packages)


def test_no_module_imports_one_that_imports_it_back():
    circles = strongly_connected(import_graph())
    assert not circles, "import circles (move what both need into a module both import):\n" + "\n".join(
        " <-> ".join(circle) for circle in circles)


def test_messages_import_nothing_above_the_bottom_layer():
    above = ("rollstream.llm", "rollstream.sandboxes", "rollstream.agent", "rollstream.tasks",
             "rollstream.workers", "rollstream.trainer", "rollstream.api", "rollstream.cli",
             "rollstream.integrations", "rollstream.pipeline")
    leaks = sorted(name for name in reachable("rollstream.messages") if in_packages(name, above))
    assert not leaks, f"rollstream.messages reaches modules above it: {leaks}"


def test_pipeline_imports_nothing_above_it():
    above = ("rollstream.llm", "rollstream.sandboxes", "rollstream.agent", "rollstream.tasks",
             "rollstream.workers", "rollstream.trainer", "rollstream.api", "rollstream.cli",
             "rollstream.integrations")
    pipeline = [name for name in modules() if in_packages(name, ("rollstream.pipeline",))]
    leaks = sorted({(name, dep) for name in pipeline for dep in import_graph()[name] if in_packages(dep, above)})
    assert not leaks, f"pipeline modules import from above the pipeline: {leaks}"


def test_the_llm_side_and_the_agent_import_nothing_above_them():
    """llm/ (clients, balancer, sessions, the run worker's LLM service) stands under agent/ (the
    loop and the door), and both under the tasks, which stand under the stages. The built-in
    server's command line is the CLI's (cli/llm.py), not a ``__main__`` of its own under llm/."""
    top = ("rollstream.tasks", "rollstream.workers", "rollstream.trainer", "rollstream.api", "rollstream.cli",
           "rollstream.integrations", "rollstream.demo", "rollstream.client")
    floors = {"rollstream.tasks": top[1:], "rollstream.agent": top, "rollstream.llm": ("rollstream.agent", *top)}
    leaks = sorted((name, dep) for package, above in floors.items() for name in modules()
                   if in_packages(name, (package,))
                   for dep in import_graph()[name] if in_packages(dep, above))
    assert not leaks, f"imports up from the LLM side, the agent or the tasks: {leaks}"


def test_stage_modules_never_import_each_other():
    stages = {f"rollstream.workers.{file.removesuffix('.py')}" for file in STAGE_FILES}
    crossings = sorted((name, dep) for name in stages for dep in import_graph()[name] if dep in stages)
    assert not crossings, f"stages import each other (share through a third module): {crossings}"


def test_shared_worker_modules_do_not_branch_on_a_stage_name():
    """Modules that drive a Stage (the consumer loop, the process) treat every stage alike; a
    stage's difference is a hook in its own file. (A module that reads which stage a *job* is
    at, like the node's reaper, compares a job's state, not its own stage.)"""
    branch = re.compile(r"""(==|!=)\s*["'](init|run|eval)["']""")
    drives_a_stage = re.compile(r"stage\.name|self\.stage\b|\bStage\b")
    offenders = []
    for path in sorted(WORKERS.glob("*.py")):
        text = path.read_text()
        if path.name in STAGE_FILES or not drives_a_stage.search(text):
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if branch.search(line.split("#", 1)[0]):
                offenders.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not offenders, ("a stage's difference belongs in its own file, as a Stage hook:\n"
                           + "\n".join(offenders))


def _lines_matching(pattern: re.Pattern, skip: set[str]) -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = str(path.relative_to(PACKAGE))
        if relative in skip or relative.startswith("data/"):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line.split("#", 1)[0]):
                found.append(f"rollstream/{relative}:{number}: {line.strip()}")
    return found


def test_the_stage_set_is_spelled_in_one_place():
    """messages.STAGES (and StageName) name the stages; elsewhere code compares with those
    names, never with a stage spelled again (the stage modules name themselves)."""
    # (A dataset's split named "eval" is no stage.)
    compared = r"""(?<!split )(==|!=)\s*["'](init|run|eval)["']"""
    listed = r"""["'](init|run)["']\s*,\s*["'](run|eval)["']"""
    spelled = re.compile(f"{compared}|{listed}")
    offenders = _lines_matching(spelled, {"messages.py", "workers/init.py", "workers/run.py", "workers/eval.py"})
    assert not offenders, "use messages.STAGES / INIT_STAGE / NODE_STAGES:\n" + "\n".join(offenders)


def test_environment_settings_are_read_in_one_place():
    """ROLLSTREAM_* variables are read by config.Settings or by the stdlib reader the sandbox
    runtime shares (sandboxes/runtime/env_settings.py), where each is documented; the SWE report
    plugin runs inside the sandbox's own Python, apart from the package."""
    read = re.compile(r"""(environ(\.get)?\s*[\[(]|getenv\()\s*f?["'](ROLLSTREAM_|RS_)""")
    apart = {"config.py", "sandboxes/runtime/env_settings.py", "tasks/swe_report_plugin.py"}
    offenders = _lines_matching(read, apart)
    assert not offenders, "read settings through config.py or runtime/env_settings.py:\n" + "\n".join(offenders)


def test_modules_stay_small():
    big = sorted((len(path.read_text().splitlines()), module_name(path)) for path in modules().values())
    too_big = [f"{name}: {lines} lines" for lines, name in big if lines > MAX_MODULE_LINES]
    assert not too_big, f"modules over {MAX_MODULE_LINES} lines hold two concepts: {too_big}"


def test_the_consumer_loop_keeps_only_what_every_stage_shares():
    homes = [path for path in WORKERS.glob("*.py")
             if re.search(r"^class ConsumerLoop\b", path.read_text(), re.MULTILINE)]
    assert len(homes) == 1, f"one module defines ConsumerLoop, found {homes}"
    lines = len(homes[0].read_text().splitlines())
    assert lines < MAX_CONSUMER_LOOP_LINES, f"{homes[0].name} has {lines} lines"


def test_every_cli_command_lives_under_cli_with_plain_imports():
    strays = sorted(str(path.relative_to(REPO)) for path in PACKAGE.rglob("cli.py"))
    assert not strays, f"command modules outside rollstream/cli/: {strays}"
    main = (PACKAGE / "cli" / "main.py").read_text()
    assert "importlib" not in main, "cli/main.py attaches commands by importlib; import them plainly"


def test_wheel_ships_the_product_without_its_harness(tmp_path):
    # Built from a copy: setuptools reuses a build/ folder, whose stale files would enter the wheel.
    source = tmp_path / "source"
    leftovers = shutil.ignore_patterns(".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__")
    shutil.copytree(REPO, source, ignore=lambda folder, names: leftovers(folder, names)
                    | ({"runs", "data"} & set(names) if Path(folder) == REPO else set()))
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--quiet", *isolation,
                    "-w", str(tmp_path)], check=True, timeout=600, cwd=tmp_path)
    (wheel,) = tmp_path.glob("rollstream-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert any(name == "rollstream/messages.py" for name in names)
    # rollstream/data/ holds task data: the SWE repositories' own tests are part of their tasks.
    harness = sorted(name for name in names if not name.startswith("rollstream/data/")
                     and re.search(r"(^|/)(chaos|soak|tests?|bench|conftest)(/|\.py$|_)", name))
    assert not harness, f"the wheel carries test/benchmark harness: {harness}"
