"""Every source package ships in a regular (non-editable) install, as ``.ci/run`` does it: the
``[tool.setuptools] packages`` list of ``pyproject.toml`` names every folder with an
``__init__.py`` under the package dirs (an editable install maps whole folders and would hide a
missing one, as it once hid ``llmd.daemon.serving.kv_transfer``)."""

from __future__ import annotations

import pathlib

import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed, dirs = set(cfg["packages"]), cfg["package-dir"]
    found = set()
    for name, folder in dirs.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join([name, *rel]))
    assert found - listed == set(), f"packages missing from pyproject.toml: {sorted(found - listed)}"
