"""specroll_jax: exact speculative rollouts for GRPO post-training in JAX."""
from specroll_jax.model.policy import Policy, load_policy

__all__ = ['Policy', 'load_policy']
