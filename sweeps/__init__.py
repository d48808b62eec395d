"""Sweep files (primary configs that extend ``train``), shipped as ``dflash_lab.sweeps``.

From a checkout or an installed wheel, in any directory: ``dflash-train -m --config-name NAME`` (the plugin in
``hydra_plugins/dflash_lab_sweeps`` puts this package on the search path); ``--config-dir sweeps`` works as well.
"""
