"""The package version, in one place (pyep.__version__, the bench JSON, packaging)."""
__version__ = "0.1.0"
