"""The code's shape, checked: no import cycles among iterserve's modules, and no
component reaching into the scheduler's state from outside, nothing in the repository
pointing outside it (docs/architecture.md, "Rules the tests enforce"). Reads the files;
imports nothing of iterserve."""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGE = SRC / "iterserve"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported_modules(path: Path, name: str, known: set[str]) -> set[str]:
    """iterserve modules `path` imports, at any depth of the file (a function-level
    import is an edge too: it runs whenever that function does)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from pkg import mod` imports the module pkg.mod; `from mod import name` mod.
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            if target in known:
                found.add(target)
    found.discard(name)
    return found


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    graph = {name: imported_modules(path, name, known) for name, path in mods.items()}
    # A module naming its own package (`from iterserve.bench import x`) is reached from
    # that package's __init__ as a matter of course: not a cycle of design.
    return {
        name: {t for t in targets if not name.startswith(t + ".")}
        for name, targets in graph.items()
    }


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_no_import_cycles() -> None:
    graph = import_graph()
    assert len(graph) > 50, "the sources were not found"
    assert find_cycles(graph) == []


def test_the_cycle_finder_finds_cycles() -> None:
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


# --- The repository stands alone: a clone with nothing beside it has all it refers to. ---

REPO = SRC.parent
_NOT_OURS = {".git", ".venv", ".venv-agents", ".venv-evals", "build", "dist", "__pycache__", ".pytest_cache",
             ".ruff_cache", ".hypothesis", "bench_results", "node_modules"}  # fmt: skip
# A sibling directory of the checkout, or this machine's absolute paths.
_OUTSIDE = re.compile(r"\.\./shared\b|(?<![\w.])/work/")
# Result files record the machine they ran on (a model's path in a label): data, not a reference.
_RECORDS = "benchmarks/results/"
_MD_LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
_MD_NAME = re.compile(r"(?<![\w/.-])([\w/.-]+\.md)\b")
_FILE_ANCHORED = re.compile(
    r"Path\(__file__\)(?:\.resolve\(\))?((?:\.parent\b)+|\.parents\[(\d+)\])"
)


def repository_text_files() -> dict[str, str]:
    """Every text file of the checkout, by path relative to its root."""
    files: dict[str, str] = {}
    for path in sorted(REPO.rglob("*")):
        relative = path.relative_to(REPO)
        if not path.is_file() or any(
            part in _NOT_OURS or part.endswith(".egg-info") for part in relative.parts
        ):
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue
        try:
            files[relative.as_posix()] = data.decode()
        except UnicodeDecodeError:
            continue
    return files


def test_no_file_refers_outside_the_repository() -> None:
    files = repository_text_files()
    assert "src/iterserve/bench/traces/azure_conv_2023.csv" in files, "the trace must ship"
    offenders = [
        f"{name}:{number}: {line.strip()[:120]}"
        for name, text in files.items()
        if name != "tests/test_structure.py"
        for number, line in enumerate(text.splitlines(), 1)
        for match in _OUTSIDE.finditer(line)
        if not (name.startswith(_RECORDS) and match.group().startswith("/"))
    ]
    assert offenders == []


def test_markdown_links_and_named_documents_exist_in_the_repository() -> None:
    files = repository_text_files()
    basenames = {Path(name).name for name in files}
    broken = []
    for name, text in files.items():
        if name.endswith(".md"):
            for target in _MD_LINK.findall(text):
                if "://" in target or target.startswith("mailto:"):
                    continue
                resolved = (REPO / name).parent.joinpath(target).resolve()
                if not resolved.is_relative_to(REPO) or not resolved.exists():
                    broken.append(f"{name}: link to {target}")
        if name.endswith((".py", ".md", ".sh", ".toml")) and name != "tests/test_structure.py":
            for doc in _MD_NAME.findall(text):
                if Path(doc).name not in basenames:
                    broken.append(f"{name}: names {doc}")
    assert broken == []


def test_file_anchored_paths_stay_inside_the_repository() -> None:
    """`Path(__file__).parents[n]` that climbs above the checkout reads what a clone lacks."""
    offenders = []
    for name, text in repository_text_files().items():
        if not name.endswith(".py") or name == "tests/test_structure.py":
            continue
        for match in _FILE_ANCHORED.finditer(text):
            levels = int(match.group(2)) + 1 if match.group(2) else match.group(1).count(".parent")
            reached = (REPO / name).parents[levels - 1] if levels <= len(Path(name).parts) else None
            if reached is None or not reached.is_relative_to(REPO):
                offenders.append(f"{name}: {match.group()}")
    assert offenders == []


def test_the_outside_reference_checks_can_fail() -> None:
    sibling = ".." + "/shared"  # spelled apart so that grep finds no such reference here
    assert _OUTSIDE.search(f"path = repo.parent / '{sibling}/traces'")
    assert _OUTSIDE.search("see /" + "work/main/README.md")
    assert not _OUTSIDE.search("src/iterserve/bench/traces/azure_conv_2023.csv")
    assert _MD_LINK.findall("see [the flags](docs/flags.md#engine) and [x](https://a.b/c)") == [
        "docs/flags.md",
        "https://a.b/c",
    ]
    assert _MD_NAME.findall("Vocabulary (DESIGN.md), docs/architecture.md.") == [
        "DESIGN.md",
        "docs/architecture.md",
    ]
    match = _FILE_ANCHORED.search("Path(__file__).resolve().parents[4]")
    assert match and match.group(2) == "4"


# Only the scheduler's own package and the engine that owns it touch its internals.
_SCHEDULER_STATE = re.compile(r"scheduler\.kv\b|\.scheduler\.running\b|\.scheduler\.requests\b")
_OWNERS = ("core/", "engine/llm_engine.py", "engine/engine_core.py")


def test_nothing_outside_the_owners_reads_the_schedulers_state() -> None:
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.startswith(_OWNERS):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if _SCHEDULER_STATE.search(line):
                offenders.append(f"{relative}:{number}: {line.strip()}")
    assert offenders == []


# The simulator builds on the engine; the engine never needs the simulator to run.
_SIMULATOR = "iterserve.sim"
_SIMULATOR_FREE = (
    "iterserve.core",
    "iterserve.engine",
    "iterserve.executor",
    "iterserve.server",
    "iterserve.replicas",
)


def test_the_engine_and_server_import_nothing_from_the_simulator() -> None:
    graph = import_graph()
    assert any(name.startswith(_SIMULATOR + ".") for name in graph), "no simulator package"
    offenders = sorted(
        f"{name} -> {target}"
        for name, targets in graph.items()
        if name.startswith(_SIMULATOR_FREE)
        for target in targets
        if target == _SIMULATOR or target.startswith(_SIMULATOR + ".")
    )
    assert offenders == []


# Packages by role, layered: the command line sits on top (nothing imports it); one engine
# knows nothing of the fleets (replicas/) or the HTTP front end (server/) built on it.
_ABOVE_THE_ENGINE = ("iterserve.cli", "iterserve.replicas", "iterserve.server")
_THE_ENGINE_AND_BELOW = ("iterserve.core", "iterserve.engine", "iterserve.executor",
                         "iterserve.model", "iterserve.sample", "iterserve.kernels")  # fmt: skip


def _inside(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def test_packages_import_only_downwards() -> None:
    graph = import_graph()
    assert any(name.startswith("iterserve.replicas.") for name in graph), "no replicas package"
    offenders = sorted(
        f"{name} -> {target}"
        for name, targets in graph.items()
        for target in targets
        if (_inside(target, ("iterserve.cli",)) and not _inside(name, ("iterserve.cli",)))
        or (_inside(name, _THE_ENGINE_AND_BELOW) and _inside(target, _ABOVE_THE_ENGINE))
    )
    assert offenders == []
