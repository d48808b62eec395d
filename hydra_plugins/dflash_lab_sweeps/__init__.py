"""Hydra search-path plugin: dflash_lab's shipped sweep files are primary configs of ``dflash-train``.

A sweep file (``sweeps/NAME.yaml``, shipped as ``dflash_lab.sweeps``) is the primary config of a multirun, and
Hydra looks up a primary config before it reads any ``hydra.searchpath``; so the sweeps join the search path here,
right after the app's own configs, for apps whose main config source is ``pkg://dflash_lab.conf`` (other Hydra
apps are left alone). Then, from any directory and from an installed wheel::

    dflash-train -m --config-name boundaries_grid

A ``--config-dir`` comes later in the search path: it adds configs, and a file named like a shipped one (``train``,
``boundaries_grid``) loses to the shipped one, so give your own files new names.
"""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

APP_CONFIGS = "pkg://dflash_lab.conf"
SWEEPS = "pkg://dflash_lab.sweeps"


class DflashLabSweepsSearchPath(SearchPathPlugin):
    """Appends ``pkg://dflash_lab.sweeps`` when the main config source is ``pkg://dflash_lab.conf``."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        paths = [element.path for element in search_path.get_path()]
        if APP_CONFIGS in paths and SWEEPS not in paths:
            search_path.append(provider="dflash_lab", path=SWEEPS)
