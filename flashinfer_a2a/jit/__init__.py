"""Building and loading the CUDA libraries.

Importing this package compiles nothing: a library is built (or its AOT copy found) on the first
:func:`get_a2a_module` call. See docs/jit_aot.md.
"""

from .modules import A2A_SOURCES, all_specs, gen_a2a_module, get_a2a_module
from .spec import JitSpec

__all__ = ["A2A_SOURCES", "JitSpec", "all_specs", "gen_a2a_module", "get_a2a_module"]
