"""A run's records on disk, below the model and data: the run files and their columns (record), the run directory and its lock, checkpoints, the JSONL/W&B logger and run names."""
