"""The forecast of a run's cost before it starts (issue #42): per stage, GPU-hours, wall time on the configured
replicas and GPUs, and disk, for the configured data size and target shape, computed from per-token costs measured on
a GPU and kept in config/costs/ with the machine, date and run they came from.

``shape`` counts the parameters a token passes through (target and EAGLE-3 draft) from a config.json, ``model`` scales
the measured costs to a config and adds them up (pure), ``__main__`` is the command (``make plan``). Nothing here
imports torch or vLLM: a plan runs where the workflow is planned, not where it runs.
"""
