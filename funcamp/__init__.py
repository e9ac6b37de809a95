"""funcamp: functional automatic mixed precision for PyTorch."""

__version__ = "0.1.0"
