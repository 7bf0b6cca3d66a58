"""What the cluster fronts (``hvdtrain.ray``, ``hvdtrain.spark``) share.

- ``job``: what each rank runs (a task with its flags, a fit script, a function and its
  arguments), checked in the driver before any rank starts;
- ``rank``: the rank started as a process of its own (``python -m hvdtrain.jobs.worker``, or
  the user's script), exactly as ``horovodrun`` starts one, its output relayed and the
  driver's stop forwarded to it;
- ``outcome``: what the ranks' answers mean for the job (done, the user's error, started again
  from the newest checkpoint), the driver's lines and its SIGINT/SIGTERM;
- ``cli``: a front's command line once its flags are parsed (its extra checked, the error
  line, the exit status).
"""
