"""Head-training pairs: the policy's hidden states with its own top-K next-token targets.

Warm start (adapt.distill), the slow path (adapt.consolidation) and the GRPO learner's
forward (rl.grpo, which harvests them at no extra policy forward) all produce or consume
this one type.
"""
import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class HeadPairs:
  hidden: jax.Array       # [B, T, D] policy hidden states
  target_ids: jax.Array   # int32 [B, T, K] policy's top-K next-token ids at each position
  target_logp: jax.Array  # float32 [B, T, K] their log-probs (renormalised over the K)
  tokens: jax.Array       # int32 [B, T] the sequence itself
  valid: jax.Array        # bool [B, T] position t holds a real token


def top_targets(logits, top_k: int):
  """The policy's top-K next-token ids and their log-probs renormalised over the K."""
  logp, ids = jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), top_k)
  return ids.astype(jnp.int32), jax.nn.log_softmax(logp, axis=-1)
