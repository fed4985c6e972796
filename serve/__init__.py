"""Serving entry points: `ling-generate` (batch generation from the command line)."""
