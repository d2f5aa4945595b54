"""The package version, in a module of its own so the server can report it without importing the package face."""

__version__ = "0.1.0"
