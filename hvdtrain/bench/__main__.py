"""``python -m hvdtrain.bench``: runs ``hvdtrain.tools.bench`` (see its ``__main__``)."""
from hvdtrain.tools.bench.__main__ import main

if __name__ == "__main__":
    raise SystemExit(main())
