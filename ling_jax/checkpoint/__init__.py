"""Checkpoint I/O: safetensors (FP8-aware) reading and writing, HF loading and export."""
