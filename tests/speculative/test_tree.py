"""Sparse trees: the budget rule, best-first prefix-closed selection, ancestor masks."""
import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from specroll_jax.speculative.head_proposer import CandidateTable
from specroll_jax.speculative.proposer import Candidates
from specroll_jax.speculative.tree import TreeConfig, build_tree


def _rank_path_candidates(branching, tokens, scores):
  """Head-style candidates: every rank path, the edge into depth d scored by (d, rank)."""
  table = CandidateTable.build(branching)
  depth, rank = table.depth - 1, table.rank
  return table, Candidates(tokens=tokens[:, depth, rank], scores=scores[:, depth, rank],
                           parent=tuple(int(p) for p in table.parent))


def test_budget_follows_concurrency():
  config = TreeConfig(capacity_tokens=256, max_nodes=64)
  running = jnp.array([1, 4, 64, 256, 1000])
  np.testing.assert_array_equal(config.budget(256, running, 64), [64, 64, 4, 1, 1])
  np.testing.assert_array_equal(config.budget(256, running, 16), [16, 16, 4, 1, 1])
  assert config.node_bucket(256, running=33) == 8   # 256 // 33 = 7 -> 8 slots
  assert config.node_bucket(256, running=1) == 64


def test_a_sized_bucket_runs_its_whole_width():
  config = TreeConfig(capacity_tokens=8, max_nodes=16, sized_widths=((1, 4), (4, 8)))
  assert [config.width(b) for b in (1, 2, 4)] == [4, 4, 8]  # bucket 2: C_hw // 2, unsized
  assert int(config.bucket_budget(4, jnp.asarray(3), 8)) == 8  # C_hw // 3 would give 2
  assert int(config.bucket_budget(2, jnp.asarray(3), 4)) == 2
  assert config.sized_width(2) is None


def test_capacity_by_batch_picks_the_nearest_measured_batch():
  config = TreeConfig(capacity_tokens=999, capacity_by_batch=((8, 16), (32, 128), (64, 128)))
  assert [config.capacity(b) for b in (1, 8, 9, 32, 64, 128)] == [16, 16, 128, 128, 128, 128]
  assert TreeConfig(capacity_tokens=999).capacity(8) == 999


def _brute_force_best(scores, branching, budget):
  """All prefix-closed rank-path sets of size budget - 1, by expected accepted length."""
  paths = [p for d in range(1, len(branching) + 1)
           for p in itertools.product(*[range(b) for b in branching[:d]])]
  value = lambda p: np.prod([scores[d, r] for d, r in enumerate(p)])
  best = -1.0
  for subset in itertools.combinations(paths, budget - 1):
    chosen = set(subset)
    if all(p[:-1] in chosen or len(p) == 1 for p in chosen):
      best = max(best, sum(value(p) for p in chosen))
  return best


@pytest.mark.parametrize('seed', range(4))
def test_tree_is_prefix_closed_and_optimal(seed):
  rng = np.random.default_rng(seed)
  probs = -np.sort(-rng.dirichlet(np.ones(4), size=(1, 3)), axis=-1)[..., :3].astype(np.float32)
  rates = rng.uniform(0, 1, size=(1, 3, 3)).astype(np.float32)
  tokens = jnp.asarray(rng.integers(10, 500, size=(1, 3, 3)), jnp.int32)
  scores = 0.5 * probs + 0.5 * rates  # the head proposer's blend at head_weight 0.5
  table, candidates = _rank_path_candidates((3, 2, 2), tokens, jnp.asarray(scores))
  for budget in (1, 3, 6):
    tree = build_tree(jnp.array([7]), candidates, jnp.array([budget]), 8, max_depth=3)
    valid = np.asarray(tree.valid[0])
    parents, depths = np.asarray(tree.parents[0]), np.asarray(tree.depths[0])
    ranks = np.where(np.asarray(tree.candidate[0]) >= 0, table.rank[tree.candidate[0]], 0)
    assert valid.sum() == budget and tree.tokens[0, 0] == 7
    rank_path = {0: ()}
    total = 0.0
    for n in range(1, budget):
      assert valid[parents[n]] and parents[n] < n and depths[n] == depths[parents[n]] + 1
      rank_path[n] = rank_path[parents[n]] + (ranks[n],)
      assert tree.tokens[0, n] == tokens[0, depths[n] - 1, ranks[n]]
      total += np.prod([scores[0, d, r] for d, r in enumerate(rank_path[n])])
    assert len(set(rank_path.values())) == budget
    if budget > 1:
      assert total == pytest.approx(_brute_force_best(scores[0], (3, 2, 2), budget), rel=1e-5)


def test_ancestor_mask():
  scores = jnp.array([[[0.9, 0.5], [0.8, 0.1]]])
  tokens = jnp.array([[[11, 12], [21, 22]]])
  _, candidates = _rank_path_candidates((2, 2), tokens, scores)
  tree = build_tree(jnp.array([1]), candidates, jnp.array([5]), 5, max_depth=2)
  mask = np.asarray(tree.ancestor_mask(2)[0])
  for n in range(5):
    expected = {n}
    node = n
    while node:
      node = int(tree.parents[0, node])
      expected.add(node)
    assert set(np.flatnonzero(mask[n])) == expected


def test_a_chain_merged_with_head_candidates_shares_the_budget():
  """A proposer's chain (a suffix match, the oracle) and per-depth head candidates in one
  tree: the best paths from either source, still prefix-closed."""
  scores = jnp.array([[[0.6, 0.3], [0.5, 0.4]]])
  tokens = jnp.array([[[11, 12], [21, 22]]])
  _, heads = _rank_path_candidates((2, 2), tokens, scores)
  chain = Candidates(tokens=jnp.array([[31, 32, 33]]), scores=jnp.array([[0.9, 0.9, 0.9]]),
                     parent=(-1, 0, 1))
  tree = build_tree(jnp.array([1]), chain.concat(heads), jnp.array([5]), 5, max_depth=3)
  # Path scores: chain 0.9, 0.81, 0.729 beat every head path (best 0.6, then 0.3).
  assert np.asarray(tree.tokens[0]).tolist() == [1, 31, 32, 33, 11]
  assert np.asarray(tree.parents[0]).tolist() == [0, 0, 1, 2, 0]
  assert np.asarray(tree.depths[0]).tolist() == [0, 1, 2, 3, 1]
  assert np.asarray(tree.candidate[0]).tolist() == [-1, 0, 1, 2, 3]


def test_per_row_parents_shape_each_row_tree():
  """Candidates 2 and 3 hang below candidate 0 in row 0 and below candidate 1 in row 1 (a
  best-first drafter's expansion): each row's tree follows its own parents, and the path
  scores that choose its nodes are its own."""
  candidates = Candidates(tokens=jnp.array([[11, 12, 21, 22], [11, 12, 21, 22]]),
                          scores=jnp.array([[0.6, 0.4, 0.9, 0.1], [0.5, 0.45, 0.9, 0.8]]),
                          parent=(-1, -1, 0, 0),
                          row_parents=jnp.array([[-1, -1, 0, 0], [-1, -1, 1, 1]]))
  tree = build_tree(jnp.array([1, 2]), candidates, jnp.array([4, 4]), 4, max_depth=2)
  # Row 0: 0.6, 0.54 (below 11), 0.4. Row 1: 0.5, 0.45, then 0.405 and 0.36 below 12.
  assert np.asarray(tree.tokens).tolist() == [[1, 11, 21, 12], [2, 11, 12, 21]]
  assert np.asarray(tree.parents).tolist() == [[0, 0, 1, 0], [0, 0, 0, 2]]
  assert np.asarray(tree.depths).tolist() == [[0, 1, 2, 1], [0, 1, 1, 2]]
  mask = np.asarray(tree.ancestor_mask(2))
  assert set(np.flatnonzero(mask[0, 2])) == {0, 1, 2}
  assert set(np.flatnonzero(mask[1, 3])) == {0, 2, 3}
  # Parents given per row that equal the static ones choose bit for bit the same trees.
  same = candidates.replace(row_parents=None)
  rowwise = same.replace(row_parents=same.parents())
  for budget in (2, 3, 4):
    a, b = (build_tree(jnp.array([1, 2]), c, jnp.array([budget, budget]), 4, max_depth=2)
            for c in (same, rowwise))
    for field in ('tokens', 'parents', 'depths', 'valid', 'candidate'):
      np.testing.assert_array_equal(np.asarray(getattr(a, field)), np.asarray(getattr(b, field)))


def test_concat_shifts_per_row_parents_past_the_first_source():
  """A static source then a per-row one: the second's parents move past the first's
  candidates, its roots stay roots, and the first's static parents become its rows'."""
  chain = Candidates(tokens=jnp.array([[31, 32], [41, 42]]), scores=jnp.ones((2, 2)),
                     parent=(-1, 0))
  grown = Candidates(tokens=jnp.array([[1, 2, 3], [1, 2, 3]]), scores=jnp.ones((2, 3)),
                     parent=(-1, -1, 0), row_parents=jnp.array([[-1, -1, 0], [-1, -1, 1]]))
  both = chain.concat(grown)
  assert both.parent == (-1, 0, -1, -1, 2)
  assert np.asarray(both.parents()).tolist() == [[-1, 0, -1, -1, 2], [-1, 0, -1, -1, 3]]
  assert both.depths.tolist() == [1, 2, 1, 1, 2]
