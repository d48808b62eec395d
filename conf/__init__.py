"""Hydra configs of ``dflash-train`` and ``dflash-plan``, shipped as the package ``dflash_lab.conf``.

The apps load them through Hydra's ``pkg://dflash_lab.conf`` search path, so they work from any directory and
from an installed wheel. This file only makes the folder an importable package (Hydra requires one).
"""
