"""Concurrency-aware sparse token trees, encoded in fixed-size arrays.

Per response and step, the node budget is N_t = clip(C_hw // B_t, 1, N_max) (B_t = running
responses); N_t = 1 is plain decoding. Candidates are paths of head ranks: depth d offers
the top `branching[d-1]` tokens of head d under every depth-(d-1) node (heads see only
h_t, so every parent gets the same candidates). A path's score is the product of its
edges' acceptance estimates, a blend of the head's own probability (dynamic, per response)
and the running acceptance rate of that (head, rank) (online statistics). Taking the N_t - 1
best paths in one total order is exact for the expected-accepted-length objective, and
prefix-closed because a child never outranks its parent (see `_order_keys`).
"""
import dataclasses
from functools import cached_property

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specroll_jax.rollout.driver import pow2_at_least

# Separates a child from a parent of equal score; far below any meaningful score gap.
_DEPTH_TIE_BREAK = 1e-4


@dataclasses.dataclass(frozen=True)
class TreeConfig:
  branching: tuple = (8, 4, 2, 2)  # candidate ranks per depth; len(branching) = heads used
  max_nodes: int = 64              # N_max, root included
  capacity_tokens: int = 1024      # C_hw: tokens one verification forward takes at the knee
  capacity_by_batch: tuple = ()    # ((batch, C_hw), ...) ascending; overrides capacity_tokens
  head_weight: float = 0.5         # weight of head probability vs online acceptance rate
  prior_strength: float = 4.0      # pseudo-trials behind the initial acceptance rates

  def __post_init__(self):
    if not self.branching or min(self.branching) < 1:
      raise ValueError(f'branching must be non-empty positive ints, got {self.branching}')
    if self.max_nodes < 1 or self.capacity_tokens < 1:
      raise ValueError('max_nodes and capacity_tokens must be >= 1')
    if not 0.0 <= self.head_weight <= 1.0:
      raise ValueError(f'head_weight must be in [0, 1], got {self.head_weight}')

  @property
  def depth(self) -> int:
    return len(self.branching)

  @property
  def top_k(self) -> int:
    return max(self.branching)

  @cached_property
  def candidates(self) -> 'CandidateTable':
    return CandidateTable.build(self.branching)

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
    return min(pow2_at_least(widest, 1), self.max_nodes, 1 + self.candidates.size)

  def budget(self, capacity: int, running: jax.Array, width: int) -> jax.Array:
    """N_t = clip(C_hw // B_t, 1, N_max) per response, capped by the compiled width."""
    return jnp.clip(capacity // jnp.maximum(running, 1), 1, min(width, self.max_nodes))


@dataclasses.dataclass(frozen=True)
class CandidateTable:
  """Every rank path a tree may use, parents listed before children (numpy, static)."""
  depth: np.ndarray       # [C] 1..H
  rank: np.ndarray        # [C] rank within its head's top-k
  parent: np.ndarray      # [C] candidate index of the parent, -1 for the root
  path_ranks: np.ndarray  # [C, H] rank at each depth along the path, -1 past its depth

  @property
  def size(self) -> int:
    return len(self.depth)

  @classmethod
  def build(cls, branching) -> 'CandidateTable':
    depth, rank, parent, paths = [], [], [], []
    frontier = [(-1, ())]
    for d, width in enumerate(branching, start=1):
      next_frontier = []
      for parent_index, ranks in frontier:
        for r in range(width):
          depth.append(d)
          rank.append(r)
          parent.append(parent_index)
          paths.append(ranks + (r,))
          next_frontier.append((len(depth) - 1, ranks + (r,)))
      frontier = next_frontier
    path_ranks = np.full((len(paths), len(branching)), -1, np.int32)
    for i, p in enumerate(paths):
      path_ranks[i, :len(p)] = p
    return cls(np.array(depth, np.int32), np.array(rank, np.int32), np.array(parent, np.int32),
               path_ranks)


@struct.dataclass
class Tree:
  """A batch of token trees with N node slots; node 0 is the root (the drawn token)."""
  tokens: jax.Array    # int32 [B, N]
  parents: jax.Array   # int32 [B, N] node index of the parent (root: 0)
  depths: jax.Array    # int32 [B, N]
  valid: jax.Array     # bool [B, N] within this row's budget
  ranks: jax.Array     # int32 [B, N] head rank of the node's token (root: 0)

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


def edge_scores(head_probs, accept_rate, config: TreeConfig):
  """Acceptance estimate per (row, head, rank) in [0, 1]."""
  return config.head_weight * head_probs + (1.0 - config.head_weight) * accept_rate


def _order_keys(edge_log_scores, table: CandidateTable):
  """Path log-score minus a depth tie-break: a child always ranks strictly below its parent.

  Scores accumulate depth by depth so a child's sum is its parent's plus a term <= 0.
  """
  batch = edge_log_scores.shape[0]
  total = jnp.zeros((batch, table.size), jnp.float32)
  for d in range(table.path_ranks.shape[1]):
    ranks = table.path_ranks[:, d]
    term = edge_log_scores[:, d, np.maximum(ranks, 0)]
    total = total + jnp.where(ranks >= 0, term, 0.0)
  return total - _DEPTH_TIE_BREAK * table.depth


def build_tree(root_tokens, head_tokens, scores, budget, width: int, config: TreeConfig) -> Tree:
  """Chooses each row's best prefix-closed tree of `budget[b]` nodes in `width` slots.

  Args:
    root_tokens: int32 [B], the drawn token at the root.
    head_tokens: int32 [B, H, K], each head's top-K tokens, best first.
    scores: float32 [B, H, K], acceptance estimate of each (head, rank) edge.
    budget: int32 [B], nodes allowed per row (root included), <= width.
  """
  table = config.candidates
  batch = root_tokens.shape[0]
  keys = _order_keys(jnp.log(jnp.clip(scores, 1e-30, 1.0)), table)
  _, chosen = jax.lax.top_k(keys, width - 1)  # [B, N-1], best first
  rows = jnp.arange(batch)[:, None]
  node_of_candidate = jnp.zeros((batch, table.size), jnp.int32).at[rows, chosen].set(
      jnp.arange(1, width, dtype=jnp.int32))
  depth = jnp.asarray(table.depth)[chosen]
  rank = jnp.asarray(table.rank)[chosen]
  parent_candidate = jnp.asarray(table.parent)[chosen]
  parent = jnp.where(parent_candidate < 0, 0,
                     node_of_candidate[rows, jnp.maximum(parent_candidate, 0)])
  tokens = head_tokens[rows, depth - 1, rank]
  zero = jnp.zeros((batch, 1), jnp.int32)
  return Tree(
      tokens=jnp.concatenate([root_tokens[:, None], tokens], axis=1),
      parents=jnp.concatenate([zero, parent], axis=1),
      depths=jnp.concatenate([zero, depth], axis=1),
      valid=jnp.arange(width)[None, :] < budget[:, None],
      ranks=jnp.concatenate([zero, rank], axis=1))
