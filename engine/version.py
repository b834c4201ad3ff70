"""pdserve's version: written once, in pyproject.toml, and read here from the installed package's metadata."""

from importlib.metadata import version

VERSION = version("pdserve")
