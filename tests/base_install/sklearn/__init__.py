"""Hidden from what the tests launch: see BASE_INSTALL in tests/conftest.py."""

raise ImportError("sklearn: not in an install of hvdtrain alone (tests/base_install)")
