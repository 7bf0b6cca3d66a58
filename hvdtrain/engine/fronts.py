"""What the run engine serves: a Task's run from the command line (``python -m hvdtrain``,
``hvdtrain.train``), or a fit script's ``hk.fit``. The engine asks its front how the user
names a setting and what its refusals and advice say; it never asks which driver called it.

    Run(world, config, CommandLine("mnist"), settings)     # the Task path
    Run(world, config, FIT_SCRIPT, settings)               # hk.fit
"""

from __future__ import annotations

from hvdtrain.base.config import fit_argument

# What defines a run that no flag or argument sets: a tf.data pipeline's input.
INPUT_FACTS = {
    "train_files": "the training files",
    "train_examples": "the training examples per epoch",
}


class CommandLine:
    """A Task's run: its settings are the command line's flags (``--learning-rate``)."""

    fit = False  # the user's code that could change a model on one rank: the task's
    run_dir, no_resume, resume = "--run-dir", "--no-resume", "--resume"
    diverged_advice = (
        "try a lower --learning-rate in a new --run-dir, or --no-stop-on-divergence to train on"
    )

    def __init__(self, name: str):
        self.name = name  # the task's: config.json's "task", the default run directory's

    def argument(self, name: str) -> str:
        """A setting as the user names it: its flag, or what the input's facts are."""
        return INPUT_FACTS.get(name) or "--" + name.replace("_", "-")


class FitScript:
    """A fit script's ``hk.fit``: its settings are hk.fit's keyword arguments, or set where the
    script builds the optimizer, the dataset and the model (``Config``'s ``fit_name``)."""

    name = "fit"
    fit = True  # the user's code that could change a model on one rank: train_step, callbacks
    run_dir, no_resume, resume = "run_dir", "resume=False", "resume=True"
    diverged_advice = (
        "try a lower learning rate on the optimizer in a new run_dir, or "
        "stop_on_divergence=False to train on"
    )

    def argument(self, name: str) -> str:
        return INPUT_FACTS.get(name) or fit_argument(name)


FIT_SCRIPT = FitScript()
