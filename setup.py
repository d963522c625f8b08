"""The compiled hot path (sidecar/hotpath.py): optional, so an install without a C compiler still succeeds."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("sidecar._hotpath", ["sidecar/_hotpath.c"], optional=True)])
