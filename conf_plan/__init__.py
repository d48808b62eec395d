"""Configs only the planner uses (group ``cost``, option ``data=lengths``), shipped as ``dflash_lab.conf_plan``.

``conf/plan.yaml`` adds ``pkg://dflash_lab.conf_plan`` to its search path; ``dflash-train`` never sees these
files, so its ``--help`` lists only groups and options training can use.
"""
