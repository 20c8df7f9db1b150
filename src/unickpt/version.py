"""The package's version (a leaf module: anything may import it without importing the package top)."""

__version__ = "0.1.0"
