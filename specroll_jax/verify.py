"""Exact sample-and-match verification of a token tree.

Walking from the root, the verifier draws the next token from the policy's distribution at
the current node with the key vanilla decoding would use for that absolute position of that
response (sampling.py's contract). If the draw is one of the node's children, the walk
descends; otherwise it stops. Every emitted token is therefore the policy's own draw given
its actual prefix: the same tokens as vanilla sampling, up to float near-ties between
differently shaped forwards. The draw that ends the walk is not emitted here: it is exactly
the next step's root draw (same logits, same key), so it is emitted there.
"""
import jax
import jax.numpy as jnp
from flax import struct

from specroll_jax import sampling
from specroll_jax.tree import Tree


@struct.dataclass
class WalkResult:
  path: jax.Array          # int32 [B, H+1] node indices of the accepted path (root first)
  accepted: jax.Array      # int32 [B] accepted nodes below the root (0..H)
  tokens: jax.Array        # int32 [B, H+1] tokens along the path (root first)
  logprobs: jax.Array      # float32 [B, H] log-prob of the draw at each depth (= path token)
  last_logits: jax.Array   # float32 [B, V] policy logits at the path's last node
  drawn: jax.Array         # int32 [B, H] verifier draw at each depth (valid where reached)
  reached: jax.Array       # bool [B, H] the walk drew at this depth


def walk(tree: Tree, hidden, project, seed_key, response_ids, root_positions,
         sampler: sampling.SamplerConfig, max_depth: int) -> WalkResult:
  """Verifies `tree` given the policy's hidden states at its nodes.

  Args:
    hidden: [B, N, D] policy hidden states at the tree nodes.
    project: hidden [B, D] -> float32 logits [B, V] (the policy's vocabulary projection).
    root_positions: int32 [B] absolute position of each root token.
  """
  batch = tree.tokens.shape[0]
  rows = jnp.arange(batch)
  current = jnp.zeros((batch,), jnp.int32)
  walking = jnp.ones((batch,), bool)
  path, logprobs, drawn, reached = [current], [], [], []
  for depth in range(1, max_depth + 1):
    logits = project(hidden[rows, current])
    keys = sampling.token_keys(seed_key, response_ids, root_positions + depth)
    y = sampling.draw(logits, keys, sampler)
    is_child = (tree.valid & (tree.parents == current[:, None]) & (tree.depths == depth)
                & (tree.tokens == y[:, None]))
    found = walking & is_child.any(axis=1)
    drawn.append(y)
    reached.append(walking)
    current = jnp.where(found, jnp.argmax(is_child, axis=1).astype(jnp.int32), current)
    path.append(jnp.where(found, current, 0))
    logprobs.append(sampling.token_logprob(logits, y, sampler))
    walking = found
  path = jnp.stack(path, axis=1)
  accepted = jnp.sum(path[:, 1:] > 0, axis=1).astype(jnp.int32)
  return WalkResult(
      path=path, accepted=accepted, tokens=jnp.take_along_axis(tree.tokens, path, axis=1),
      logprobs=jnp.stack(logprobs, axis=1), last_logits=project(hidden[rows, current]),
      drawn=jnp.stack(drawn, axis=1), reached=jnp.stack(reached, axis=1))
