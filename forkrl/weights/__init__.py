"""Weights on disk and on the wire: atomic HF checkpoints with trainer state, safetensors listing and
headers, and the chunked, checksummed state-dict format of UpdateWeights."""
