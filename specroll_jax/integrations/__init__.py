"""Adapters that offer this project's rollouts to other training libraries (optional extras)."""
