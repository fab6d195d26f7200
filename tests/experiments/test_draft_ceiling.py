"""Static trees of rank paths (experiments.lib.rank_trees) on hand-made draw ranks."""
import numpy as np
import pytest

from experiments.lib.rank_trees import (RANKS, best_tree, drafter_rank_paths, held_out_tau,
                                        is_spine, rank_paths, tree_tau)


def test_rank_paths_stop_at_a_miss_the_depth_and_the_answer_end():
  ranks = np.array([0, 1, RANKS, 0, 0])
  assert rank_paths(ranks, 2) == [(0, 1), (1,), (), (0, 0), (0,)]


def test_best_tree_keeps_the_most_frequent_prefixes_and_is_prefix_closed():
  paths = [(0, 0, 0)] * 5 + [(1, 0)] * 3 + [(0, 1)] * 2
  # Prefix counts: (0,) 7, (0, 0) 5, (0, 0, 0) 5, (1,) 3, (1, 0) 3, (0, 1) 2.
  tree = best_tree(paths, nodes=4)
  assert tree == {(0,), (0, 0), (0, 0, 0)}
  # Accepted depths 3 (x5), 0 (x3), 1 (x2): 1 + 17 / 10, a mean of floats (approx: 2.7 has
  # no exact binary form; the counts themselves are exact).
  assert tree_tau(tree, paths) == pytest.approx(2.7)
  # A wider tree: (1,) and (1, 0) join, and the (1, 0) draws are accepted to depth 2.
  assert best_tree(paths, nodes=6) == tree | {(1,), (1, 0)}
  assert tree_tau(best_tree(paths, nodes=6), paths) == pytest.approx(1 + 23 / 10)
  assert tree_tau(best_tree(paths, nodes=1), paths) == 1.0


def test_drafter_rank_paths_and_spine_restricted_trees():
  # Per position, the drawn token's rank at each depth; a path stops at its first miss.
  ranks = np.array([[0, 0, 1, RANKS + 1], [1, 0, RANKS, 0], [RANKS, 0, 0, 0]])
  assert drafter_rank_paths(ranks) == [(0, 0, 1), (1, 0), ()]
  paths = [(1, 0)] * 2 + [(0, 0, 1)]
  # Prefix counts: (1,) 2, (1, 0) 2, (0,) 1, (0, 0) 1, (0, 0, 1) 1; (1, 0) leaves the spine.
  assert best_tree(paths, 3) == {(1,), (1, 0)}
  assert best_tree(paths, 3, is_spine) == {(1,), (0,)}
  assert is_spine((0, 0, 3)) and not is_spine((0, 1, 0))
  # Chosen on one half, measured on the other: both halves choose (1,), (1, 0); it accepts
  # 2, 2 and 0 drafted tokens on the second half (tau 7/3) and 2 on the first (tau 3).
  halves = [[(1, 0)], [(1, 0), (1, 0), (0,)]]
  assert held_out_tau(halves, 3) == pytest.approx((7 / 3 + 3) / 2)
