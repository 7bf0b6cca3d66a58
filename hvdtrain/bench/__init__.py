"""``python -m hvdtrain.bench``: the benchmark suite, a developer's tool that lives in
``hvdtrain.tools.bench``; this name keeps the command."""
