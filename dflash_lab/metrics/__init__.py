"""Metrics, each defined once (METRICS.md): throughput, plan diversity, loss jumpiness, forgetting."""
