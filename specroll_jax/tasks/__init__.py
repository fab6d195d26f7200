"""Prompt sources, datasets, answer checking, the synthetic task and the W1 policy it pretrains."""
