"""Distillation pairs for any learned proposer (heads, drafter): the policy's hidden states
with its own top-K next-token targets.

Warm start (adapt.distill), the slow path (adapt.consolidation) and the GRPO learner's
forward (rl.grpo, which harvests them at no extra policy forward) all produce or consume
this one type.
"""
from functools import partial

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class DistillPairs:
  hidden: jax.Array       # [B, T, D] policy hidden states
  target_ids: jax.Array   # int32 [B, T, K] policy's top-K next-token ids at each position
  target_logp: jax.Array  # float32 [B, T, K] their log-probs (renormalised over the K)
  tokens: jax.Array       # int32 [B, T] the sequence itself
  valid: jax.Array        # bool [B, T] position t holds a real token


def top_targets(logits, top_k: int):
  """The policy's top-K next-token ids and their log-probs renormalised over the K."""
  logp, ids = jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), top_k)
  return ids.astype(jnp.int32), jax.nn.log_softmax(logp, axis=-1)


def shifted(x, shift: int):
  """x[:, t + shift] at t (zeros past the end), so row t lines up with a later position."""
  tail = jnp.zeros((x.shape[0], shift) + x.shape[2:], x.dtype)
  return jnp.concatenate([x[:, shift:], tail], axis=1)


def span_positions(starts, length: int, width: int):
  """Rows' positions [start, start + length) clipped to the row: (index [B, length], inside
  [B, length], False where the span runs past the row)."""
  index = starts[:, None] + jnp.arange(length)[None, :]
  return jnp.minimum(index, width - 1), index < width


def take_positions(x, index):
  """x [B, T, ...] at per-row positions index [B, S] -> [B, S, ...]."""
  return jnp.take_along_axis(x, index.reshape(index.shape + (1,) * (x.ndim - 2)), axis=1)


@partial(jax.jit, static_argnums=2)
def response_spans(pairs: DistillPairs, starts, length: int) -> DistillPairs:
  """Rows' positions [start, start + length): with start = the last prompt position this is
  every pair whose horizon lies in the response, at a fraction of a full-width batch's
  cost (prompts are most of a row's width in math tasks)."""
  index, inside = span_positions(starts, length, pairs.tokens.shape[1])
  spans = jax.tree.map(lambda x: take_positions(x, index), pairs)
  return spans.replace(valid=spans.valid & inside)
