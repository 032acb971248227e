"""Seeing the run: metrics.jsonl, the console and progress bar, W&B with its dashboard and
workspace, alerts, and the live-bytes meter."""
