"""Rollouts: the sampler and its randomness contract, output sequences, the engine-agnostic
driver and the vanilla engine."""
