"""Launching on a cluster: the checks Hydra runs before a (Slurm or local) multirun submits anything, and the protocol a sweep freezes at launch."""
