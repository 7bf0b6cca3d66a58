"""hvdtrain's version: a leaf, so that setup.py and preflight read it without importing the rest."""
__version__ = "0.2.0"
