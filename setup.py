"""The one compiled part of kvtier: streaming copies of blocks into slots
(kvtier/_blockcopy.c, kvtier/blockcopy.py). Optional: where it cannot be
built the package installs without it and copies with memcpy."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvtier._blockcopy", ["kvtier/_blockcopy.c"], optional=True)])
