"""The layout of the package: imports flow one way along the data flow, and the tree is what its docs say.

The folder harness/ is the package ``ssdiff`` (kernels/ is ``ssdiff.kernels``). Its parts, in the order a case
flows through them; a module may import only from its own part or the parts before it:

    kernels      ssdiff's own Triton kernels: nothing of the harness
    runtime      the Triton interpreter or a GPU, in one place
    exits        the exit-status contract of every command and repro
    model        the Case, its features, axes, stages, dtypes, what an evaluation returns, the strategies
    truth        the float64 oracles (equations over tensors)
    inputs       a case's tensors (a decode case's starting state is the truth of its prefill, so after truth)
    budget       the same-precision model and its samples
    verdict      judging against the budget; statuses; error maps
    sides        implementations: the registry, adapters, the runner, upstream loading, stand-ins, doubles
    examine      the Examiner: the one place evidence is assembled and sides are judged
    store        the saved-run format
    reproduce    repro.py
    investigate  localize, shrink, minimize, replay, the TF32 re-examination, metamorphic relations
    registry     known-defect records, their error models, the explain rule, the findings catalogue
    report       HTML from saved runs (a campaign renders its own)
    campaign     the fuzz campaign, its compile pool and scheduling, --jobs
    tools        benchmarks, calibration, kernel tuning, the oracle self-check
    (top)        the public API (ssdiff/__init__.py, api.py), the pytest plugin, test support, the CLI

Every import counts, function-local ones included, and no two modules import each other through any chain.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PARTS = ("kernels", "runtime", "exits", "model", "truth", "inputs", "budget", "verdict", "sides", "examine", "store",
         "reproduce", "investigate", "registry", "report", "campaign", "tools", "(top)")
TOP = ("", "api", "plugin", "testing", "cli")      # "" is ssdiff/__init__.py: the public API


def modules(root: Path) -> dict:
    """Dotted module name -> source path of every module of ``root``'s harness/ (as ssdiff) and kernels/
    (as ssdiff.kernels)."""
    found = {}
    for folder, name in (("harness", "ssdiff"), ("kernels", "ssdiff.kernels")):
        for path in sorted((root / folder).rglob("*.py")):
            parts = path.relative_to(root / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((name, *parts))] = path
    return found


def part_of(module: str) -> str:
    """The part a module belongs to (PARTS)."""
    rest = module.split(".")[1:]
    if rest[:1] == ["kernels"]:
        return "kernels"
    first = rest[0] if rest else ""
    return "(top)" if first in TOP else first


def imports_of(module: str, path: Path, known: dict) -> list:
    """(line, imported ssdiff module) of every import in ``path``, at any depth: relative imports resolved, and a
    name imported from a package counted as its submodule where there is one."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source
                       for alias in node.names]
        else:
            continue
        for target in targets:
            if target.split(".")[0] in ("ssdiff", "harness", "kernels", "properties"):
                out.append((node.lineno, target))
    return out


def violations(root: Path) -> list:
    """Every import against the declared order, and every import of a top-level name other than ssdiff."""
    known = modules(root)
    rank = {part: i for i, part in enumerate(PARTS)}
    problems = []
    for module, path in known.items():
        here = part_of(module)
        if here not in rank:
            problems.append(f"{path.relative_to(root)}: part {here!r} is not in the declared order")
            continue
        for line, target in imports_of(module, path, known):
            where = f"{path.relative_to(root)}:{line}"
            if not target.startswith("ssdiff"):
                problems.append(f"{where}: imports {target} (the one import name is ssdiff)")
            elif target not in known:
                problems.append(f"{where}: imports {target}, which does not exist")
            elif rank[part_of(target)] > rank[here]:
                problems.append(f"{where}: {here} imports {target} ({part_of(target)} comes after {here})")
    return problems


def cycles(root: Path) -> list:
    """Each set of modules that import one another through a chain (strongly connected components)."""
    known = modules(root)
    graph = {m: {t for _, t in imports_of(m, p, known) if t in known and t != m} for m, p in known.items()}
    # a package's __init__ runs when its submodules are imported: not an edge of the data flow
    graph = {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in graph.items()}
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                found.append(sorted(scc))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_imports_flow_one_way_along_the_data_flow():
    problems = violations(REPO)
    assert not problems, "\n".join(problems)


def test_no_modules_import_each_other():
    found = cycles(REPO)
    assert not found, "\n".join(" <-> ".join(c) for c in found)


def _planted(tmp_path: Path, module: str, line: str) -> Path:
    """A copy of the tree's sources with ``line`` added at the end of ``module``'s file."""
    for folder in ("harness", "kernels"):
        for path in (REPO / folder).rglob("*.py"):
            target = tmp_path / path.relative_to(REPO)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(path.read_text(encoding="utf-8"), encoding="utf-8")
    path = modules(tmp_path)[module]
    path.write_text(path.read_text(encoding="utf-8") + f"\n\ndef planted():\n    {line}\n", encoding="utf-8")
    return tmp_path


@pytest.mark.parametrize("module, line, says", [
    ("ssdiff.model.case", "from ssdiff.examine import Examiner", "model imports ssdiff.examine"),
    ("ssdiff.verdict.judge", "from ..sides import registry", "verdict imports ssdiff.sides.registry"),
    ("ssdiff.kernels.ssd.combined", "from ssdiff import runtime", "kernels imports ssdiff.runtime"),
    ("ssdiff.examine", "import harness.runtime", "the one import name is ssdiff"),
])
def test_a_planted_upward_import_is_caught(tmp_path, module, line, says):
    problems = violations(_planted(tmp_path, module, line))
    assert any(says in p for p in problems), problems


def test_a_planted_cycle_is_caught(tmp_path):
    tree = _planted(tmp_path, "ssdiff.model.case", "from ssdiff.model import features")
    assert any({"ssdiff.model.case", "ssdiff.model.features"} <= set(c) for c in cycles(tree)), cycles(tree)


def test_every_package_is_named_in_pyproject():
    """setuptools installs exactly the packages pyproject.toml names: a new folder must be listed there."""
    named = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {m for m, p in modules(REPO).items() if p.name == "__init__.py"}
    assert named == packages, f"missing: {sorted(packages - named)}; not in the tree: {sorted(named - packages)}"
