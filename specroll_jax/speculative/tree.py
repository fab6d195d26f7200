"""Concurrency-aware sparse token trees, encoded in fixed-size arrays.

Per response and step, the node budget is N_t = clip(C_hw // B_t, 1, N_max) (B_t = running
responses); N_t = 1 is plain decoding. A batch bucket may instead have a sized width
(`sized_widths`, chosen by speculative.step_cost.size_trees from the measured price and tokens per
step of each candidate width): its trees then have exactly that many nodes. The nodes are
chosen from a proposer's candidates (edges with an estimated acceptance probability,
speculative/proposer.py): a path's score is the product of its edges' scores, i.e. the probability
that the verifier accepts the whole path, so the expected accepted length of a tree is the
sum of its nodes' path scores.
Taking the N_t - 1 best paths in one total order maximises it and is prefix-closed,
because a child never outranks its parent (see `_order_keys`).
"""
import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from specroll_jax.rollout.buckets import pow2_at_least
from specroll_jax.speculative.proposer import Candidates

# Separates a child from a parent of equal score; far below any meaningful score gap.
_DEPTH_TIE_BREAK = 1e-4


@dataclasses.dataclass(frozen=True)
class TreeConfig:
  max_nodes: int = 64              # N_max, root included
  capacity_tokens: int = 1024      # C_hw: tokens one verification forward takes at the knee
  capacity_by_batch: tuple = ()    # ((batch, C_hw), ...) ascending; overrides capacity_tokens
  sized_widths: tuple = ()         # ((batch, nodes), ...) ascending; overrides the budget there
  one_projection: tuple = ()       # batches whose walk projects every node at once

  def __post_init__(self):
    if self.max_nodes < 1 or self.capacity_tokens < 1:
      raise ValueError('max_nodes and capacity_tokens must be >= 1')

  def capacity(self, batch: int) -> int:
    """C_hw for a batch bucket: the profiled knee of the nearest measured batch at or above
    it (the largest measured one beyond the table), else the single capacity_tokens."""
    if not self.capacity_by_batch:
      return self.capacity_tokens
    return next((tokens for b, tokens in self.capacity_by_batch if b >= batch),
                self.capacity_by_batch[-1][1])

  def node_bucket(self, capacity: int, running: int) -> int:
    """Static tree width for `running` rows: N_t rounded up to a power of two."""
    widest = min(self.max_nodes, max(1, capacity // max(1, running)))
    return min(pow2_at_least(widest, 1), self.max_nodes)

  def budget(self, capacity: int, running: jax.Array, width: int) -> jax.Array:
    """N_t = clip(C_hw // B_t, 1, N_max) per response, capped by the compiled width."""
    return jnp.clip(capacity // jnp.maximum(running, 1), 1, min(width, self.max_nodes))

  def sized_width(self, batch: int) -> int | None:
    """The width sized for this batch bucket, or None where the capacity decides."""
    return dict(self.sized_widths).get(batch)

  def projects_all_nodes(self, batch: int) -> bool:
    """Whether the walk at this batch bucket projects every node before it starts."""
    return batch in self.one_projection

  def width(self, batch: int) -> int:
    """Static node slots for a batch bucket: its sized width, else the budget of a full
    bucket, C_hw(B) // B, as a power of two."""
    sized = self.sized_width(batch)
    return sized if sized is not None else self.node_bucket(self.capacity(batch), batch)

  def bucket_budget(self, batch: int, running: jax.Array, width: int) -> jax.Array:
    """The per-response budget in a bucket of `batch` rows with `running` still running: the
    whole width where it was sized (its price and return were measured at that width),
    else N_t."""
    if self.sized_width(batch) is not None:
      return jnp.asarray(width, jnp.int32)
    return self.budget(self.capacity(batch), running, width)


@struct.dataclass
class Tree:
  """A batch of token trees with N node slots; node 0 is the root (the drawn token)."""
  tokens: jax.Array     # int32 [B, N]
  parents: jax.Array    # int32 [B, N] node index of the parent (root: 0)
  depths: jax.Array     # int32 [B, N]
  valid: jax.Array      # bool [B, N] within this row's budget
  candidate: jax.Array  # int32 [B, N] the proposer candidate each node is (root: -1)

  def ancestor_mask(self, max_depth: int) -> jax.Array:
    """[B, N, N]: node i sees node j iff j is i or an ancestor of i (tree attention)."""
    batch, width = self.parents.shape
    mask = jnp.broadcast_to(jnp.eye(width, dtype=bool), (batch, width, width))
    current = jnp.broadcast_to(jnp.arange(width), (batch, width))
    rows = jnp.arange(batch)[:, None]
    for _ in range(max_depth):
      current = self.parents[rows, current]
      mask = mask | jax.nn.one_hot(current, width, dtype=bool)
    return mask


def _order_keys(candidates: Candidates):
  """(path log-score minus a depth tie-break, depth [C]) per candidate: a child always ranks
  strictly below its parent, because its log-score is its parent's plus a term <= 0.
  Terms are added from depth 1 down, so equal edges give bit-equal path scores."""
  edge = jnp.log(jnp.clip(candidates.scores, 1e-30, 1.0))
  depth = candidates.depths
  return candidates.along_paths(edge, jnp.add, 0.0) - _DEPTH_TIE_BREAK * depth, depth


def build_tree(root_tokens, candidates: Candidates, budget, width: int, max_depth: int) -> Tree:
  """Chooses each row's best prefix-closed tree of `budget[b]` nodes in `width` slots.

  Args:
    root_tokens: int32 [B], the drawn token at the root.
    candidates: the proposer's edges, parents first, at most `max_depth` deep (their parents
      may differ per row: the tree's parents are per row either way).
    budget: int32 [B], nodes allowed per row (root included), <= width.
  """
  batch = root_tokens.shape[0]
  keys, depths = _order_keys(candidates)
  if depths.max(initial=0) > max_depth:
    raise ValueError(f'candidates reach depth {depths.max()} but the tree has {max_depth} levels')
  _, chosen = jax.lax.top_k(keys, width - 1)  # [B, N-1], best first
  rows = jnp.arange(batch)[:, None]
  node_of_candidate = jnp.zeros((batch, candidates.size), jnp.int32).at[rows, chosen].set(
      jnp.arange(1, width, dtype=jnp.int32))
  parent_candidate = candidates.parents()[rows, chosen]
  parent = jnp.where(parent_candidate < 0, 0,
                     node_of_candidate[rows, jnp.maximum(parent_candidate, 0)])
  zero = jnp.zeros((batch, 1), jnp.int32)
  return Tree(
      tokens=jnp.concatenate([root_tokens[:, None], candidates.tokens[rows, chosen]], axis=1),
      parents=jnp.concatenate([zero, parent], axis=1),
      depths=jnp.concatenate([zero, jnp.asarray(depths)[chosen]], axis=1),
      valid=jnp.arange(width)[None, :] < budget[:, None],
      candidate=jnp.concatenate([zero - 1, chosen.astype(jnp.int32)], axis=1))
