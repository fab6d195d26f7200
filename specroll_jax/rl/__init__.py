"""Reinforcement learning: GRPO, the training loop that drives rollouts and adaptation, reports."""
