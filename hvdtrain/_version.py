"""hvdtrain's version: a leaf, so that setup.py and preflight read it without importing the rest."""

__version__ = "0.2.0"
"""hvdtrain's version, as pip and ``hvdtrain.__version__`` give it."""
