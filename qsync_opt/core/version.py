"""The package's version, one place (pyproject.toml's ``version`` says the same: tests/test_layout.py)."""

__version__ = "0.1.0"
