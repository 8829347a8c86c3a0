"""The one door into the compiled library: the ``flashinfer_a2a::<name>`` ops with their fakes and the bound eager
calls (:mod:`.ops`), the constants the library exports (:mod:`.constants`), the argument checks (:mod:`.checks`), the
workspace layout, sizes and views (:mod:`.layout`, :mod:`.sizing`), the error record (:mod:`.errors`) and the wire
formats (:mod:`.wire_formats`, :mod:`.combine_mode`). No module outside this package loads the built module.
"""
