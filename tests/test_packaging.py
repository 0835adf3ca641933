"""The installed package holds every subpackage of the source tree.

A subpackage missing from pyproject's list installs without error and fails only when a user's
import reaches it (CI's user install met that once: ``ssdtrain.device`` was left out). This
compares the list with the tree, so the next new subpackage fails here first.
"""
import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _listed():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return set(config["packages"]), config.get("package-dir", {})


def test_every_subpackage_of_ssdtrain_is_listed_in_pyproject():
    listed, _ = _listed()
    found = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for init in (ROOT / "ssdtrain").rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    missing = sorted(found - listed)
    assert not missing, f"add {missing} to [tool.setuptools] packages in pyproject.toml"


def test_every_listed_package_exists():
    listed, dirs = _listed()
    for name in listed:
        where = ROOT / dirs.get(name, name.replace(".", "/"))
        assert where.is_dir(), f"pyproject lists {name}, but {where} is not a folder"
