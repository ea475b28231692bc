"""The package version, defined once. Imports nothing."""

__version__ = "0.1.0"
