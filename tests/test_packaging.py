"""The distribution's name and version in one place each, and the install command a missing
extra names (fast; the built wheel itself: tests/test_wheel.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from dflash import DISTRIBUTION, __version__
from dflash.cli import main
from dflash.errors import MissingDependencyError, install_hint, missing_extra

ROOT = Path(__file__).resolve().parents[1]


def pyproject() -> dict:
    if sys.version_info < (3, 11):
        tomllib = pytest.importorskip("tomli")
    else:
        import tomllib
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_pyproject_names_the_distribution_and_reads_the_version_from_the_package():
    meta = pyproject()
    assert meta["project"]["name"] == DISTRIBUTION != "dflash"  # `dflash` on PyPI is z-lab's
    assert meta["project"]["dynamic"] == ["version"]
    assert meta["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "dflash.__version__"}
    assert meta["project"]["license"] == "Apache-2.0"
    assert meta["project"]["license-files"] == ["LICENSE"]
    assert {"serve", "bench", "cpu", "cuda", "dev"} <= set(meta["project"]["optional-dependencies"])
    assert any(r.startswith("build") for r in meta["project"]["optional-dependencies"]["dev"])


def test_version_flag_names_the_distribution(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"dflash {__version__} ({DISTRIBUTION})"


def test_a_missing_extra_names_the_command_under_this_distributions_name():
    assert install_hint("bench") == f"pip install '{DISTRIBUTION}[bench]'"
    e = missing_extra("serve", "the server needs FastAPI")
    assert isinstance(e, MissingDependencyError) and isinstance(e, ValueError)
    assert str(e) == f"the server needs FastAPI: pip install '{DISTRIBUTION}[serve]'"
