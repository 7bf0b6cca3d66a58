"""The ground floor: what every other part of hvdtrain stands on.

- ``errors``: every error hvdtrain reports, in one line, with its exit status;
- ``config``: ``Config``, the training settings every run shares, and what each field means
  for a run (a command-line flag, a fit script's argument or not, defines the run or not);
- ``flags``: a task's command line, one flag per field of ``Config`` and of its ``Settings``;
- ``files``: files that readers see whole or not at all, and storage errors said in one line;
- ``compat``: which Keras hvdtrain trains with (Keras 3, or tf_keras) and its variables;
- ``precision``: Keras' mixed-precision policies and dynamic loss scaling;
- ``timings``: the clock of result.json's timings (started first after ``malloc``, by
  ``hvdtrain/__init__``);
- ``tflogs``: TensorFlow's start-up lines kept quiet;
- ``importhooks``: a module's loader wrapped at its first import (``timings``' and ``tflogs``');
- ``launch``: what the launcher says (how many processes, this one's rank, its cores);
- ``malloc``: glibc's huge-page tunable for the ranks (a launched rank without it starts
  itself again with it: ``hvdtrain/__init__``'s first code, then ``timings``).

May import: nothing of hvdtrain outside this package. This file imports nothing, so that
``malloc`` and ``timings`` are the first code to run.
"""
