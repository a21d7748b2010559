"""tpcomm's version (``tpcomm.__version__``; the ranks of a group must agree on it)."""

__version__ = "0.1.0"
