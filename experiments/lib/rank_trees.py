"""Static draft trees as sets of rank paths, measured on the ranks of a policy's own draws.

A drafter that knows the policy's law proposes, below each accepted path, the children of
given ranks in that law; a T=1 walk accepts to depth d when the draws' ranks (r_1..r_d)
form a path of the tree. A tree is a prefix-closed set of rank paths, and its accepted
depth on a draw sequence counts the tree's nodes on the draws' path, so the best N-node
tree holds the N-1 most frequent rank paths (a path is never more frequent than its prefix).
Used by experiments.measure.draft_ceiling (the policy's own law) and
experiments.measure.drafter_trees (the drafter's law, whose ranks depend on the depth).
"""
import jax
import numpy as np

from specroll_jax.adapt.drafter_training import drawn_ranks

# Ranks at or above this are misses: the policy's top-RANKS is all a law is read to.
RANKS = 8
# Answers per teacher-forced drafter forward (its laws over the draft vocabulary are large).
ROWS_PER_FORWARD = 8


def rank_paths(ranks: np.ndarray, depth: int):
  """Every position's path of draw ranks, as long as the draws stay within the top RANKS,
  the answer lasts and `depth` allows: tuples of ranks, one per position of `ranks` [L]."""
  paths = []
  for i in range(len(ranks)):
    path = []
    for r in ranks[i:i + depth]:
      if r >= RANKS:
        break
      path.append(int(r))
    paths.append(tuple(path))
  return paths


def drafter_rank_paths(ranks: np.ndarray):
  """Rank paths of a drafter's laws: ranks [L, depth] holds, at each position, the drawn
  token's rank at each depth (RANKS or more: a miss); each path stops at its first miss."""
  paths = []
  for row in np.asarray(ranks):
    misses = np.flatnonzero(row >= RANKS)
    paths.append(tuple(int(r) for r in row[:misses[0] if len(misses) else len(row)]))
  return paths


def is_spine(path) -> bool:
  """Whether a rank path stays below the best guesses until its last step."""
  return all(r == 0 for r in path[:-1])


def best_tree(paths, nodes: int, allowed=lambda path: True) -> set:
  """The `nodes` - 1 most frequent non-empty path prefixes that `allowed` admits (ties:
  shallower first, so the set is prefix-closed when `allowed` admits every prefix of what
  it admits)."""
  counts = {}
  for path in paths:
    for d in range(1, len(path) + 1):
      if allowed(path[:d]):
        counts[path[:d]] = counts.get(path[:d], 0) + 1
  ranked = sorted(counts, key=lambda prefix: (-counts[prefix], len(prefix), prefix))
  return set(ranked[:nodes - 1])


def tree_tau(tree: set, paths) -> float:
  """Tokens per verification of `tree` on these draws: 1 + the longest accepted prefix."""
  accepted = [next((d for d in range(len(p), 0, -1) if p[:d] in tree), 0) for p in paths]
  return 1.0 + float(np.mean(accepted))


def two_fold_tau(ranks_by_answer: list, nodes: int, depth: int) -> float:
  """The best tree chosen on even answers measured on odd ones and the reverse, averaged."""
  halves = [[p for a in ranks_by_answer[k::2] for p in rank_paths(a, depth)] for k in (0, 1)]
  return held_out_tau(halves, nodes)


def held_out_tau(halves, nodes: int, allowed=lambda path: True) -> float:
  """The best tree chosen on one half of the rank paths and measured on the other, both
  ways, averaged."""
  return float(np.mean([tree_tau(best_tree(halves[k], nodes, allowed), halves[1 - k])
                        for k in (0, 1)]))


def drafter_answer_paths(config, drafter, policy, pairs) -> list:
  """The drafter's rank paths at every position of `pairs` whose next token (the root the
  verifier draws) is real."""
  paths = []
  for start in range(0, pairs.tokens.shape[0], ROWS_PER_FORWARD):
    chunk = jax.tree.map(lambda x: x[start:start + ROWS_PER_FORWARD], pairs)
    ranks = np.asarray(drawn_ranks(config, policy.config, drafter, policy.params, chunk, RANKS))
    valid = np.asarray(chunk.valid)
    roots = valid & np.pad(valid[:, 1:], ((0, 0), (0, 1)))
    paths += drafter_rank_paths(ranks[roots])
  return paths
