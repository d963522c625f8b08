"""The one compiled part of the package: the safekeeper's Append stream (csrc/streamloop.c).

Optional: without a C compiler and Python's headers the package installs without it, and the
safekeeper serves its stream with the Python reference (sidecar/safekeeper/streamloop.py chooses,
and WALSIDECAR_IMPL=compiled makes its absence an error). Everything else is in pyproject.toml.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("sidecar.safekeeper._streamloop", ["csrc/streamloop.c"], optional=True,
                             extra_compile_args=["-O2", "-Wall", "-Werror=implicit-function-declaration"])])
