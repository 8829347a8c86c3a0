"""Sphinx configuration. The build imports the package (for autodoc) but compiles nothing and needs no GPU."""

import sys
from pathlib import Path

# Document the checkout this file sits in, installed or not.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flashinfer_a2a._version import __version__  # noqa: E402

project = "flashinfer_a2a"
author = "flashinfer_a2a developers"
version = release = __version__

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build"]
myst_enable_extensions = ["colon_fence"]
# Markdown headings become link targets, so pages can point at each other's sections.
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "description"
html_theme = "alabaster"
