"""Metrics, each defined once (formulas: docs/metrics.md): throughput, plan diversity, loss jumpiness, forgetting."""
