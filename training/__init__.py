"""Data pipelines, target and drafter training, offline evaluation."""
