"""Exact sample-and-match verification of a token tree.

Walking from the root, the verifier draws the next token from the policy's distribution at
the current node with the key vanilla decoding would use for that absolute position of that
response (sampling.py's contract). If the draw is one of the node's children, the walk
descends; otherwise it stops. Every emitted token is therefore the policy's own draw given
its actual prefix: the same tokens as vanilla sampling, up to float near-ties between
differently shaped forwards. The draw that ends the walk is not emitted here: it is exactly
the next step's root draw (same logits, same key), so it is emitted there.

The walk is a `lax.while_loop` over depth that stops as soon as no row is still descending:
with typical acceptance most steps end after one or two projections instead of H + 1.
"""
import jax
import jax.numpy as jnp
from flax import struct

from specroll_jax.rollout import sampling
from specroll_jax.spec.tree import Tree


@struct.dataclass
class WalkResult:
  path: jax.Array          # int32 [B, H+1] node indices of the accepted path (root first)
  accepted: jax.Array      # int32 [B] accepted nodes below the root (0..H)
  tokens: jax.Array        # int32 [B, H+1] tokens along the path (root first)
  logprobs: jax.Array      # float32 [B, H] log-prob of the draw at each depth (= path token)
  last_logits: jax.Array   # float32 [B, V] policy logits at the path's last node
  drawn: jax.Array         # int32 [B, H] verifier draw at each depth (valid where reached)
  reached: jax.Array       # bool [B, H] the walk drew at this depth
  target_ids: jax.Array    # int32 [B, H, M] top-M of the policy's distribution at each depth
  target_probs: jax.Array  # float32 [B, H, M] their probabilities (the sampler's transform)


def walk(tree: Tree, hidden, project, seed_key, response_ids, root_positions,
         sampler: sampling.SamplerConfig, max_depth: int, vocab_size: int,
         sketch_size: int) -> WalkResult:
  """Verifies `tree` given the policy's hidden states at its nodes.

  Args:
    hidden: [B, N, D] policy hidden states at the tree nodes.
    project: hidden [B, D] -> float32 logits [B, V] (the policy's vocabulary projection).
    root_positions: int32 [B] absolute position of each root token.
    max_depth: deepest tree level (H); the walk projects at most H + 1 nodes per row.
    sketch_size: M, how many of the policy's top tokens to keep at each drawn depth (the
      delayed feedback Reflex and the slow-path monitor learn from).
  """
  batch = tree.tokens.shape[0]
  rows = jnp.arange(batch)

  def descend(carry):
    depth, current, walking, path, logprobs, drawn, reached, last_logits, sketch = carry
    logits = project(hidden[rows, current])
    keys = sampling.token_keys(seed_key, response_ids, root_positions + depth)
    probs = sampling.distribution(logits, sampler)
    y = sampling.draw(logits, keys, sampler, probs)
    is_child = (tree.valid & (tree.parents == current[:, None]) & (tree.depths == depth)
                & (tree.tokens == y[:, None]))
    found = walking & is_child.any(axis=1)
    # A row whose walk ends here keeps these logits: they seed its next step.
    last_logits = jnp.where((walking & ~found)[:, None], logits, last_logits)
    current = jnp.where(found, jnp.argmax(is_child, axis=1).astype(jnp.int32), current)
    slot = jnp.minimum(depth, max_depth) - 1  # depth H + 1 only projects; nothing to record
    record = depth <= max_depth
    path = path.at[:, depth].set(jnp.where(found, current, 0), mode='drop')
    logprobs = jnp.where(record, logprobs.at[:, slot].set(
        sampling.token_logprob(logits, y, sampler)), logprobs)
    drawn = jnp.where(record, drawn.at[:, slot].set(y), drawn)
    reached = jnp.where(record, reached.at[:, slot].set(walking), reached)
    top_probs, top_ids = jax.lax.top_k(probs, sketch_size)
    sketch = jax.tree.map(lambda buf, x: jnp.where(record, buf.at[:, slot].set(x), buf),
                          sketch, (top_ids.astype(jnp.int32), top_probs))
    return depth + 1, current, found, path, logprobs, drawn, reached, last_logits, sketch

  init = (jnp.int32(1), jnp.zeros((batch,), jnp.int32), jnp.ones((batch,), bool),
          jnp.zeros((batch, max_depth + 1), jnp.int32),
          jnp.zeros((batch, max_depth), jnp.float32), jnp.zeros((batch, max_depth), jnp.int32),
          jnp.zeros((batch, max_depth), bool), jnp.zeros((batch, vocab_size), jnp.float32),
          (jnp.zeros((batch, max_depth, sketch_size), jnp.int32),
           jnp.zeros((batch, max_depth, sketch_size), jnp.float32)))
  _, _, _, path, logprobs, drawn, reached, last_logits, sketch = jax.lax.while_loop(
      lambda c: (c[0] <= max_depth + 1) & c[2].any(), descend, init)
  accepted = jnp.sum(path[:, 1:] > 0, axis=1).astype(jnp.int32)
  return WalkResult(
      path=path, accepted=accepted, tokens=jnp.take_along_axis(tree.tokens, path, axis=1),
      logprobs=logprobs, last_logits=last_logits, drawn=drawn, reached=reached,
      target_ids=sketch[0], target_probs=sketch[1])
