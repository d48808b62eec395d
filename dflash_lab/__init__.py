"""dflash_lab: measure how batching policies change the speed and learning of DFlash draft-model training."""

__version__ = "0.1.0"
