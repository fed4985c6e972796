"""Continued pretraining of Ling-3 models: `ling-train` (data, optimizer, step, checkpoints, metrics)."""
