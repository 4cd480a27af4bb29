"""The public API is importable from the package top, and importing the package loads nothing heavy."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import sdtrt

INIT = Path(sdtrt.__file__)


def test_every_public_name_resolves_to_the_object_its_module_defines():
    import importlib

    for name in sdtrt.__all__:
        value = getattr(sdtrt, name)
        if name in sdtrt._STAGES:
            assert value is importlib.import_module(f"sdtrt.stages.{name}")
        elif name != "__version__":
            assert value is getattr(importlib.import_module(sdtrt._EXPORTS[name]), name), name


def test_an_unknown_name_is_an_attribute_error():
    try:
        sdtrt.no_such_thing  # noqa: B018
    except AttributeError as error:
        assert "no_such_thing" in str(error)
    else:
        raise AssertionError("sdtrt.no_such_thing resolved")


def test_type_checkers_see_the_same_names_the_package_serves():
    """The TYPE_CHECKING imports (what IDEs and mypy read) name exactly the lazily served public names."""
    tree = ast.parse(INIT.read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING")
    typed = {alias.asname or alias.name for node in block.body for alias in node.names}
    assert typed == set(sdtrt.__all__) - {"__version__"}


def test_importing_the_package_and_its_api_names_loads_no_heavy_library():
    code = (
        "import sys, sdtrt; sdtrt.__all__; dir(sdtrt);"
        "heavy = [m for m in ('torch', 'diffusers', 'onnx', 'onnxruntime') if m in sys.modules];"
        "print(heavy); sys.exit(bool(heavy))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
