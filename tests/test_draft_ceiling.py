"""Static trees of rank paths (experiments.rank_trees) on hand-made draw ranks."""
import numpy as np
import pytest

from experiments.rank_trees import RANKS, best_tree, rank_paths, tree_tau


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
