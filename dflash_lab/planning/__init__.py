"""The planner's parts (``python -m dflash_lab.plan`` is the command; ``dflash_lab.plan`` re-exports every name):

* ``config``: its config groups and keys, the compared policies' sampler configs, the data's lengths;
* ``cost``: the cost model (linear or FLOP-priced, the target online or off the trainer GPUs), the prediction of a
  plan's Ktok/s and ETA, the calibration warning;
* ``table``: the plan table, one row per policy (memory plan and columns included), and the bucket-count sweep;
* ``report``: the printed tables' columns and legend, the lines under them, the recommendation.
"""
