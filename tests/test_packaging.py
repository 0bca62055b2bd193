"""What an installed muser needs besides its Python files: every other file of the package is
package data in pyproject.toml (a wheel holds it), and the native build's cache key covers
every file the C compiler reads."""

from __future__ import annotations

import fnmatch
import re
import tomllib
from pathlib import Path

from muser.ops import native

ROOT = Path(__file__).resolve().parents[1]


def test_every_data_file_ships():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"]
    package_root = ROOT / "muser"
    files = [p for p in package_root.rglob("*") if p.is_file() and p.suffix not in (".py", ".pyc")
             and "__pycache__" not in p.parts]
    assert files  # the C sources and the shipped picks at least
    for path in files:
        package = ".".join(path.parent.relative_to(ROOT).parts)
        patterns = data.get(package, [])
        assert any(fnmatch.fnmatch(path.name, pat) for pat in patterns), (
            f"{path.relative_to(ROOT)} is not package data of {package} in pyproject.toml")


def test_native_build_key_covers_every_included_file():
    included = {name for src in native.SOURCES + native.HEADERS
                for name in re.findall(r'#include "([^"]+)"', src.read_text())}
    assert included <= {h.name for h in native.HEADERS}
    assert all(p.exists() for p in native.SOURCES + native.HEADERS)
