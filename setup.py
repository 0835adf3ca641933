"""The optional compiled pack (Note [a compiled pack for the common save] in ``ssdtrain/engine/
native.py``): built at install where a C compiler and Python's headers are, skipped (pure Python,
the same results) where not. Everything else about the package is in ``pyproject.toml``."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("ssdtrain._cpack", ["cuda_ext/_cpack.c"], optional=True)])
