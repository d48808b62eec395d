"""The analysis notebook, shipped in the wheel as ``dflash_lab.notebooks`` (``dflash_lab/notebooks`` links here).

Open it over a runs folder (copy it first: the installed file is the package's)::

    cp "$(python -c 'from dflash_lab.notebooks import COMPARE_POLICIES; print(COMPARE_POLICIES)')" .
    DFLASH_RUNS=multirun/boundaries_grid/<time> jupyter lab compare_policies.ipynb
"""

from pathlib import Path

COMPARE_POLICIES = Path(__file__).resolve().with_name("compare_policies.ipynb")
