"""Exact sample-and-match verification of a token tree.

Walking from the root, the verifier draws the next token from the policy's distribution at
the current node with the key vanilla decoding would use for that absolute position of that
response (sampling.py's contract). If the draw is one of the node's children, the walk
descends; otherwise it stops. Every emitted token is therefore the policy's own draw given
its actual prefix: the same tokens as vanilla sampling, up to float near-ties between
differently shaped forwards. The draw that ends the walk is not emitted here: it is exactly
the next step's root draw (same logits, same key), so it is emitted there.

The walk is a `lax.while_loop` over depth that stops as soon as no row is still descending:
with typical acceptance most steps end after one or two projections instead of H + 1. Where
one projection of every tree node costs about what one per-depth projection does (a few
rows: each reads the whole embedding), the engine projects them all before the walk and the
walk only indexes those logits (`TreeConfig.one_projection`, chosen by measurement).
"""
import jax
import jax.numpy as jnp
from flax import struct

from specroll_jax.rollout import sampling
from specroll_jax.speculative.proposer import Feedback
from specroll_jax.speculative.tree import Tree


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

  def at_last_node(self, features) -> jax.Array:
    """[B, F] of the tree forward's features [B, N, F] at each row's last accepted node (the
    next step's h_t and layer features)."""
    last_node = self.path[jnp.arange(self.path.shape[0]), self.accepted]
    return jnp.take_along_axis(features, last_node[:, None, None], axis=1)[:, 0]

  def feedback(self, running, levels: int, features) -> Feedback:
    """What proposers and statistics learn from this walk (draws of running rows only),
    given the tree forward's features [B, N, F]."""
    return Feedback(drawn=self.drawn, drew=self.reached & running[:, None],
                    accepted=self.accepted, target_ids=self.target_ids,
                    target_probs=self.target_probs,
                    path_features=jnp.take_along_axis(features, self.path[:, :, None], axis=1),
                    levels=levels)


@struct.dataclass
class WalkState:
  """The walk's carry: where each row stands, and what it has drawn at each depth so far."""
  depth: jax.Array         # int32 [] the level drawn next (1 = the root's children)
  current: jax.Array       # int32 [B] the node each row stands on
  walking: jax.Array       # bool [B] the row is still descending
  path: jax.Array          # int32 [B, H+1] accepted nodes by depth (0 = none)
  logprobs: jax.Array      # float32 [B, H]
  drawn: jax.Array         # int32 [B, H]
  reached: jax.Array       # bool [B, H]
  last_logits: jax.Array   # float32 [B, V] logits where the row stopped
  target_ids: jax.Array    # int32 [B, H, M]
  target_probs: jax.Array  # float32 [B, H, M]

  @classmethod
  def init(cls, batch: int, max_depth: int, vocab_size: int, top_m: int) -> 'WalkState':
    per_depth = lambda dtype, *extra: jnp.zeros((batch, max_depth) + extra, dtype)
    return cls(depth=jnp.int32(1), current=jnp.zeros((batch,), jnp.int32),
               walking=jnp.ones((batch,), bool),
               path=jnp.zeros((batch, max_depth + 1), jnp.int32),
               logprobs=per_depth(jnp.float32), drawn=per_depth(jnp.int32),
               reached=per_depth(bool), last_logits=jnp.zeros((batch, vocab_size), jnp.float32),
               target_ids=per_depth(jnp.int32, top_m), target_probs=per_depth(jnp.float32, top_m))

  def record(self, logits, weights, draw, child, sampler: sampling.SamplerConfig) -> 'WalkState':
    """Advances one level: `draw` [B] was drawn from `logits` (the sampler's log-weights
    `weights`) at the current node, `child` [B] is the node it matched (-1: none, the walk
    stops there)."""
    found = self.walking & (child >= 0)
    max_depth = self.drawn.shape[1]
    slot = jnp.minimum(self.depth, max_depth) - 1  # depth H + 1 only projects; nothing to record
    recorded = self.depth <= max_depth
    at_slot = lambda buffer, value: jnp.where(recorded, buffer.at[:, slot].set(value), buffer)
    target_ids, target_probs = self.target_ids, self.target_probs
    top_m = target_ids.shape[-1]
    if top_m:  # static: a softmax and a top-k over the vocabulary, only for a reader
      top_probs, top_ids = jax.lax.top_k(jax.nn.softmax(weights, axis=-1), top_m)
      target_ids = at_slot(target_ids, top_ids.astype(jnp.int32))
      target_probs = at_slot(target_probs, top_probs)
    current = jnp.where(found, child, self.current)
    return WalkState(
        depth=self.depth + 1, current=current, walking=found,
        path=self.path.at[:, self.depth].set(jnp.where(found, current, 0), mode='drop'),
        logprobs=at_slot(self.logprobs, sampling.token_logprob(logits, draw, sampler)),
        drawn=at_slot(self.drawn, draw), reached=at_slot(self.reached, self.walking),
        # A row whose walk ends here keeps these logits: they seed its next step.
        last_logits=jnp.where((self.walking & ~found)[:, None], logits, self.last_logits),
        target_ids=target_ids, target_probs=target_probs)

  def result(self, tree: Tree) -> WalkResult:
    return WalkResult(
        path=self.path, accepted=jnp.sum(self.path[:, 1:] > 0, axis=1).astype(jnp.int32),
        tokens=jnp.take_along_axis(tree.tokens, self.path, axis=1), logprobs=self.logprobs,
        last_logits=self.last_logits, drawn=self.drawn, reached=self.reached,
        target_ids=self.target_ids, target_probs=self.target_probs)


def walk(tree: Tree, node_logits, seed_key, response_ids, root_positions,
         sampler: sampling.SamplerConfig, max_depth: int, vocab_size: int,
         top_m: int) -> WalkResult:
  """Verifies `tree` given the policy's logits at its nodes.

  Args:
    node_logits: node index per row, int32 [B] -> float32 logits [B, V] of the policy at
      those nodes (projected on demand, or taken from a projection of every node).
    root_positions: int32 [B] absolute position of each root token.
    max_depth: deepest tree level (H); the walk projects at most H + 1 nodes per row.
    top_m: M, how many of the policy's top tokens to keep at each drawn depth (the
      delayed feedback Reflex and the slow-path monitor learn from; 0: none, and the walk
      runs no softmax or top-k over the vocabulary).
  """
  def descend(state: WalkState) -> WalkState:
    logits = node_logits(state.current)
    keys = sampling.token_keys(seed_key, response_ids, root_positions + state.depth)
    weights = sampling.log_weights(logits, sampler)
    draw = sampling.draw(logits, keys, sampler, weights)
    is_child = (tree.valid & (tree.parents == state.current[:, None])
                & (tree.depths == state.depth) & (tree.tokens == draw[:, None]))
    child = jnp.where(is_child.any(axis=1), jnp.argmax(is_child, axis=1), -1).astype(jnp.int32)
    return state.record(logits, weights, draw, child, sampler)

  init = WalkState.init(tree.tokens.shape[0], max_depth, vocab_size, top_m)
  final = jax.lax.while_loop(lambda s: (s.depth <= max_depth + 1) & s.walking.any(), descend,
                             init)
  return final.result(tree)
