"""The policy itself: config, transformer, attention, KV cache and prefill, HF checkpoints, mesh."""
