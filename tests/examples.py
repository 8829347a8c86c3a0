"""Imports the example programs under docs/examples (not a package) for the tests that keep them working."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "docs" / "examples"


def example(name: str):
    """The module ``docs/examples/<name>.py``, imported once."""
    key = f"_flashinfer_a2a_example_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, EXAMPLES / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module  # before exec: dataclasses look their module up while it runs
        spec.loader.exec_module(module)
    return sys.modules[key]
