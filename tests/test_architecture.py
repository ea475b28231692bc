"""The layout holds: no import cycles, and the client stays light to import.

The one-way rules themselves are import-linter contracts (pyproject.toml,
run by ``make test``); these check what the contracts cannot say.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kvtier"
HEAVY = ("pydantic", "pydantic_settings", "aiobotocore", "botocore", "prometheus_client", "aiohttp")


def test_the_import_graph_has_no_cycles() -> None:
    """Imports made only for type checking count: a circle hidden behind
    ``TYPE_CHECKING`` is still one (a connection knows its server as the
    ``Host`` protocol it declares, not as the ``Server`` that owns it)."""
    graph = grimp.build_graph("kvtier", exclude_type_checking_imports=False)
    cycles = []
    for module in sorted(graph.modules):
        for imported in graph.find_modules_directly_imported_by(module):
            if imported == module or not imported.startswith("kvtier"):
                continue
            back = graph.find_shortest_chain(importer=imported, imported=module)
            if back is not None:
                cycles.append((module, *back))
    assert not cycles, f"import cycles: {cycles}"


def _modules_loaded_by(statement: str) -> set[str]:
    code = f"{statement}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout))


def test_import_kvtier_for_the_client_loads_no_daemon_stack() -> None:
    for statement in (
        "import kvtier",
        "from kvtier import BlockingClient, Client, LookupMode",
        "from kvtier.client import Client",
    ):
        loaded = _modules_loaded_by(statement)
        heavy = sorted(m for m in loaded if m.split(".")[0] in HEAVY)
        assert not heavy, f"{statement!r} loaded {heavy[:5]}"
        assert not any(m.startswith(("kvtier.core", "kvtier.server")) for m in loaded)


def test_config_still_loads_on_first_use() -> None:
    loaded = _modules_loaded_by("import kvtier\nkvtier.load_config")
    assert "pydantic" in loaded and "kvtier.config" in loaded


def _layout() -> str:
    """The README's map of the code (its "Layout" block)."""
    readme = (ROOT / "README.md").read_text()
    found = re.search(r"^## Layout\n.*?```\n(.*?)```", readme, re.S | re.M)
    assert found is not None, "README.md has no Layout block"
    return found.group(1)


def test_the_readme_map_names_every_module_and_only_files_that_exist() -> None:
    block = _layout()
    named = set(re.findall(r"\b([a-z_]+\.py)\b", block))
    folders = set(re.findall(r"\b([a-z_]+)/", block))
    files = {p.name for p in PACKAGE.rglob("*.py")} | {
        p.name for p in (ROOT / "benchmarks").glob("*.py")
    }
    assert named <= files, f"the map names files that do not exist: {sorted(named - files)}"
    plumbing = {"__init__.py", "__main__.py", "_version.py"}
    for where in (PACKAGE, PACKAGE / "core"):
        modules = {p.name for p in where.glob("*.py")} - plumbing
        assert modules <= named, f"not in the README's map: {sorted(modules - named)}"
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert packages <= folders, f"not in the README's map: {sorted(packages - folders)}"


def test_the_docs_name_only_modules_that_exist() -> None:
    wings = "core|server|tiers|wire|client|supervisors|integrations"
    for doc in (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))):
        for path in re.findall(rf"`((?:{wings})/[a-z_/]+\.py)`", doc.read_text()):
            assert (PACKAGE / path).exists(), f"{doc.name} names {path}, which does not exist"
