"""hvdtrain's build: the metadata (name, version, requirements, extras, package data) and the
tools' settings are in pyproject.toml; this file is kept for the layout and for tools that look
for it."""
from setuptools import setup

setup()
