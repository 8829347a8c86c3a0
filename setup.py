"""Only job: mark a wheel that carries AOT libraries (flashinfer_a2a/_aot/) as platform-specific.

Everything else is in pyproject.toml. The libraries are machine code for one platform but call no Python C API
(tvm-ffi's C ABI), so such a wheel is `py3-none-<platform>`; a wheel without them stays `py3-none-any`.
"""

from pathlib import Path

from setuptools import Distribution, setup

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1 kept it in `wheel`; an offline --no-build-isolation install may meet one
    from wheel.bdist_wheel import bdist_wheel

_AOT_DIR = Path(__file__).resolve().parent / "flashinfer_a2a" / "_aot"


class AotDistribution(Distribution):
    # Read by bdist_wheel (pure or not) and by build/install (purelib or platlib layout).
    def has_ext_modules(self):
        return any(_AOT_DIR.glob("*/*.so"))


class BdistWheel(bdist_wheel):
    def get_tag(self):
        python, abi, plat = super().get_tag()
        if not self.root_is_pure:
            python, abi = "py3", "none"
        return python, abi, plat


setup(distclass=AotDistribution, cmdclass={"bdist_wheel": BdistWheel})
