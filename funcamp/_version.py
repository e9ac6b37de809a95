"""The package's version, in a module of its own so that modules inside the package can read it without
importing the top package (which imports them)."""

__version__ = "0.1.0"
