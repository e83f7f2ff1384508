"""The package as users install it: a folder of megatron_offload without ``__init__.py`` is left out by
``find_packages``, so an editable install (the tests') works while the wheel users install does not
import. scripts/check_install.sh installs it for real; these tests catch the cause in the CPU suite."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "megatron_offload"


def source_folders() -> list[Path]:
    """Every folder of the package that holds Python files."""
    return sorted({path.parent for path in PACKAGE.rglob("*.py") if "__pycache__" not in path.parts})


def test_every_folder_with_python_files_is_a_package() -> None:
    missing = [str(folder.relative_to(ROOT)) for folder in source_folders() if not (folder / "__init__.py").is_file()]
    assert not missing, f"add an __init__.py (a one-line docstring and __all__) to: {missing}"


def test_find_packages_installs_every_folder() -> None:
    setuptools = pytest.importorskip("setuptools", reason="setuptools (pyproject.toml's build requirement) is missing")
    found = set(setuptools.find_packages(where=str(ROOT), include=["megatron_offload", "megatron_offload.*"]))
    folders = {".".join(folder.relative_to(ROOT).parts) for folder in source_folders()}
    assert folders - found == set(), "these folders would be missing from the wheel"


@pytest.mark.parametrize("init", sorted(PACKAGE.rglob("__init__.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_each_package_says_what_it_holds(init: Path) -> None:
    tree = ast.parse(init.read_text())
    assert ast.get_docstring(tree), f"{init.relative_to(ROOT)} has no docstring"
    assigned = [t for node in tree.body if isinstance(node, ast.Assign) for t in node.targets]
    assert "__all__" in [t.id for t in assigned if isinstance(t, ast.Name)], f"{init.relative_to(ROOT)} has no __all__"


def test_tests_and_benchmarks_import_packages_not_paths() -> None:
    """Tests and benchmarks reach what they reuse as packages (tests.drills, benchmarks), never by putting a
    folder on sys.path."""
    path_edit = re.compile(r"sys\.path(\.insert|\.append|\[:0\])")
    found = []
    for folder in ("tests", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if path_edit.search(line) and "path_edit" not in line:
                    found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)
