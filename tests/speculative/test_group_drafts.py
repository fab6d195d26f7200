"""Group drafts: the matcher, the sibling buffer, the merge with the heads' candidates, and
the calibration that takes nodes away from a source that stops paying."""
import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from specroll_jax.rollout.driver import take_rows
from specroll_jax.rollout.sequences import Sequences
from specroll_jax.speculative.group_proposer import (GroupBuffer, GroupDraftConfig, GroupProposer,
                                              GroupRecord, GroupStats, best_path_value,
                                              match_chains, merge, refresh, row_tail,
                                              sibling_ids)
from specroll_jax.speculative.proposer import Candidates, Feedback, Proposal, StepContext
from specroll_jax.speculative.tree import build_tree

GAP = -1


def _corpus(*segments):
  row = []
  for segment in segments:
    row += list(segment) + [GAP]
  return jnp.asarray([row], jnp.int32)


def _tail(*backwards, length=6):
  return jnp.asarray([list(backwards) + [-2] * (length - len(backwards))], jnp.int32)


def test_longest_match_wins_over_a_more_frequent_shorter_one():
  config = GroupDraftConfig(chains=2, chain_depth=3, min_match=1, max_match=6, matches=8)
  # "3 4" occurs three times followed by 9; "2 3 4" once, followed by 7 8.
  corpus = _corpus([3, 4, 9], [3, 4, 9], [3, 4, 9], [1, 2, 3, 4, 7, 8])
  tokens, frequency = match_chains(config, corpus, _tail(4, 3, 2))
  np.testing.assert_array_equal(tokens[0, 0], [7, 8, 0])
  np.testing.assert_allclose(frequency[0, 0], [1.0, 1.0, 0.0])  # one occurrence; the gap ends it
  np.testing.assert_array_equal(frequency[0, 1], [0, 0, 0])  # no second continuation


def test_frequency_scores_and_distinct_first_tokens():
  config = GroupDraftConfig(chains=3, chain_depth=2, min_match=2, max_match=4, matches=8)
  corpus = _corpus([5, 6, 7, 8], [5, 6, 7, 1], [5, 6, 9, 9], [5, 6, 7, 1])
  tokens, frequency = match_chains(config, corpus, _tail(6, 5))
  # 7 follows 3 of 4 occurrences; below it 1 follows 2 of those 3 (the most recent is kept).
  np.testing.assert_array_equal(tokens[0, 0], [7, 1])
  np.testing.assert_allclose(frequency[0, 0], [0.75, 2 / 3], rtol=1e-6)
  np.testing.assert_array_equal(tokens[0, 1], [9, 9])
  np.testing.assert_allclose(frequency[0, 1], [0.25, 1.0])
  np.testing.assert_array_equal(frequency[0, 2], [0, 0])


def test_no_match_below_min_match_and_none_across_a_gap():
  config = GroupDraftConfig(chains=1, chain_depth=2, min_match=2, max_match=4, matches=4)
  # "5 | 6 7": 5 and 6 are adjacent only across a gap, so the tail "5 6" never occurs.
  tokens, frequency = match_chains(config, _corpus([1, 5], [6, 7]), _tail(6, 5))
  assert float(frequency.sum()) == 0.0
  tokens, frequency = match_chains(config, _corpus([1, 6, 7]), _tail(6, 5))
  assert float(frequency.sum()) == 0.0  # only "6" matches: shorter than min_match


def _seqs(tokens, lengths, response_ids, prompt_lengths, done=None):
  tokens = jnp.asarray(tokens, jnp.int32)
  batch = tokens.shape[0]
  done = jnp.zeros((batch,), bool) if done is None else jnp.asarray(done)
  return Sequences(tokens=tokens, logprobs=jnp.zeros(tokens.shape), num_generated=jnp.asarray(
      lengths, jnp.int32), done=done, hit_eos=jnp.zeros((batch,), bool),
      response_ids=jnp.asarray(response_ids, jnp.int32),
      prompt_lengths=jnp.asarray(prompt_lengths, jnp.int32),
      max_new_tokens=jnp.full((batch,), tokens.shape[1], jnp.int32),
      steps=jnp.zeros((batch,), jnp.int32))


def test_tail_reads_the_root_then_the_response_then_the_prompt():
  prompt = jnp.asarray([[11, 12, 13, GAP], [21, 22, GAP, GAP]], jnp.int32)
  seqs = _seqs([[1, 2, 99], [3, 99, 99]], [2, 1], [0, 1], [3, 2])
  tail = row_tail(prompt, seqs.prompt_lengths, seqs, jnp.asarray([7, 8]), 6)
  np.testing.assert_array_equal(tail, [[7, 2, 1, 13, 12, 11], [8, 3, 22, 21, -2, -2]])


def test_siblings_share_a_prompt_and_padding_has_none():
  prompts = jnp.asarray([[1, 2], [3, 4], [1, 2], [1, 2], [1, 2]], jnp.int32)
  ids = sibling_ids(prompts, jnp.full((5,), 2), jnp.asarray([0, 4, 1, 2, 0]),
                    jnp.asarray([False, False, False, False, True]), max_siblings=4)
  np.testing.assert_array_equal(ids, [[0, 1, 2, -1], [4, -1, -1, -1], [0, 1, 2, -1],
                                      [0, 1, 2, -1], [-1, -1, -1, -1]])


def _buffer(seqs, prompt):
  ids = sibling_ids(prompt, seqs.prompt_lengths, seqs.response_ids, seqs.done, 2)
  batch, width = seqs.tokens.shape
  return GroupBuffer(prompt=prompt, sibling_ids=ids,
                     sibling_tokens=jnp.full((batch, 2, width), GAP, jnp.int32),
                     sibling_lengths=jnp.zeros((batch, 2), jnp.int32))


def test_sibling_buffer_survives_compaction_and_reads_no_unemitted_token():
  prompt = jnp.asarray([[5, 6], [5, 6]], jnp.int32)
  # Slots past num_generated hold junk (99): what this step may still write.
  seqs = _seqs([[1, 2, 99, 99], [3, 99, 99, 99]], [2, 1], [0, 1], [2, 2])
  buffer = refresh(_buffer(seqs, prompt), seqs)
  np.testing.assert_array_equal(buffer.sibling_tokens[0], [[1, 2, GAP, GAP], [3, GAP, GAP, GAP]])
  np.testing.assert_array_equal(buffer.sibling_lengths, [[2, 1], [2, 1]])
  assert 99 not in np.asarray(buffer.corpus())
  # Row 1 finishes after two more tokens; the batch is compacted to row 0 only.
  seqs = _seqs([[1, 2, 4, 99], [3, 8, 9, 99]], [3, 3], [0, 1], [2, 2], done=[False, True])
  buffer = refresh(buffer, seqs)
  kept = jnp.asarray([0])
  seqs, buffer = take_rows(seqs, kept), take_rows(buffer, kept)
  seqs = seqs.replace(tokens=seqs.tokens.at[0, 3].set(7), num_generated=jnp.asarray([4]))
  buffer = refresh(buffer, seqs)
  np.testing.assert_array_equal(buffer.sibling_tokens[0], [[1, 2, 4, 7], [3, 8, 9, GAP]])
  np.testing.assert_array_equal(buffer.sibling_lengths[0], [4, 3])


def test_a_sibling_in_padding_rows_with_the_same_id_is_read_from_its_real_row():
  prompt = jnp.asarray([[5], [5], [5]], jnp.int32)
  seqs = _seqs([[1, 2], [0, 0], [0, 0]], [2, 0, 0], [0, 0, 0], [1, 1, 1],
               done=[False, True, True])
  buffer = refresh(_buffer(seqs, prompt), seqs)
  np.testing.assert_array_equal(buffer.sibling_tokens[0, 0], [1, 2])


def _ancestors(parent):
  """(ancestors [C, D] from depth 1 down to each candidate itself, -1 padded; depth [C])."""
  chains = []
  for c, p in enumerate(parent):
    chains.append((chains[p] if p >= 0 else []) + [c])
  ancestors = np.full((len(parent), max(map(len, chains))), -1)
  for c, chain in enumerate(chains):
    ancestors[c, :len(chain)] = chain
  return ancestors, np.array([len(chain) for chain in chains])


def _best_path(tokens, scores, parent, c):
  """Brute force: the best sum of path scores along any path down from candidate c."""
  ancestors, depth = _ancestors(parent)
  path = lambda k: float(np.prod(scores[ancestors[k, :depth[k]]]))
  below = [k for k in range(len(parent)) if c in ancestors[k, :depth[k]]]
  leaves = [k for k in below if not any(parent[j] == k for j in range(len(parent)))]
  return max(sum(path(a) for a in ancestors[leaf, :depth[leaf]] if depth[a] >= depth[c])
             for leaf in leaves)


@pytest.mark.parametrize('seed', range(6))
def test_merged_tree_keeps_the_more_valuable_duplicate_and_is_optimal(seed):
  rng = np.random.default_rng(seed)
  # Tokens from a small vocabulary so that the sources often start with the same token.
  chain_tokens = rng.integers(1, 4, size=(2, 3)).astype(np.int32)
  chain_tokens[1, 0] = 1 + chain_tokens[0, 0] % 3  # distinct first tokens
  chain_scores = rng.uniform(0.05, 1.0, size=(2, 3)).astype(np.float32)
  chain_scores[1, 2] = 0.0  # the second chain is two tokens long
  parent = (-1, -1, 0, 0, 1, 1)
  # Siblings in the base are distinct, as a head's ranks are.
  base_tokens = np.concatenate([rng.permutation(3)[:2] + 1 for _ in range(3)])
  base_scores = rng.uniform(0.05, 1.0, size=6).astype(np.float32)
  base = Candidates(tokens=jnp.asarray(base_tokens[None], jnp.int32),
                    scores=jnp.asarray(base_scores[None]), parent=parent)
  merged_chain, merged_base = merge(jnp.asarray(chain_tokens)[None],
                                    jnp.asarray(chain_scores)[None], base)
  merged_chain, merged_base = np.asarray(merged_chain[0]), np.asarray(merged_base[0])
  np.testing.assert_array_equal(merged_chain[:, 1:], chain_scores[:, 1:])
  np.testing.assert_array_equal(merged_base[2:], base_scores[2:])
  for c in range(2):
    if chain_tokens[c, 0] not in base_tokens[:2]:
      assert merged_chain[c, 0] == chain_scores[c, 0]  # no conflict, nothing changes
    for root in (0, 1):
      if chain_tokens[c, 0] != base_tokens[root]:
        continue
      chain_value = float(np.sum(np.cumprod(chain_scores[c])))
      base_value = _best_path(base_tokens, base_scores, parent, root)
      if chain_value > base_value:
        assert merged_base[root] == 0 and merged_chain[c, 0] == chain_scores[c, 0]
      else:
        assert merged_chain[c, 0] == 0 and merged_base[root] == base_scores[root]
  candidates = Candidates(tokens=jnp.asarray(chain_tokens.reshape(1, -1)),
                          scores=jnp.asarray(merged_chain.reshape(1, -1)),
                          parent=(-1, 0, 1, -1, 3, 4)).concat(
                              base.replace(scores=jnp.asarray(merged_base)[None]))
  # The tree builder's choice against brute force over the merged candidates' live paths.
  ancestors, depth = _ancestors(candidates.parent)
  tokens, scores = np.asarray(candidates.tokens[0]), np.asarray(candidates.scores[0])
  value = {}
  for c in range(candidates.size):
    chain = ancestors[c, :depth[c]]
    if np.all(scores[chain] > 0):
      path = tuple(tokens[chain])
      assert path not in value, f'token path {path} offered twice'
      value[path] = float(np.prod(scores[chain]))
  paths = list(value)
  for budget in (2, 4, 6):
    best = 0.0
    for subset in itertools.combinations(paths, min(budget - 1, len(paths))):
      chosen = set(subset)
      if all(len(p) == 1 or p[:-1] in chosen for p in chosen):
        best = max(best, sum(value[p] for p in chosen))
    tree = build_tree(jnp.array([9]), candidates, jnp.array([budget]), 8, max_depth=3)
    chosen = np.asarray(tree.candidate[0, 1:budget])
    picked = [tuple(tokens[ancestors[c, :depth[c]]]) for c in chosen if scores[c] > 0]
    got = sum(value.get(p, 0.0) for p in picked)
    np.testing.assert_allclose(got, best, rtol=1e-5)


def test_a_source_that_stops_paying_stops_getting_nodes():
  config = GroupDraftConfig()
  fresh = GroupStats.zeros(1)
  np.testing.assert_allclose(fresh.calibration(config), [config.prior_acceptance])
  # 40 chain nodes reached with frequency 1, none drawn: the factor falls toward 0.
  failing = fresh.replace(reached=jnp.asarray([40.0]), predicted=jnp.asarray([40.0]))
  assert float(failing.calibration(config)[0]) < 0.05
  paying = fresh.replace(reached=jnp.asarray([40.0]), predicted=jnp.asarray([40.0]),
                         hits=jnp.asarray([36.0]))
  assert float(paying.calibration(config)[0]) > 0.85


def test_observe_counts_reached_chain_nodes_and_accepted_tokens():
  proposer = GroupProposer(GroupDraftConfig(chains=2, chain_depth=3, max_siblings=1))
  prompt = jnp.asarray([[5, 6]], jnp.int32)
  seqs = _seqs([[0, 0, 0, 0]], [0], [0], [2])
  state = proposer.init(prompt, seqs)
  record = GroupRecord(base=None, tokens=jnp.asarray([[[4, 5, 6], [7, 8, 0]]], jnp.int32),
                       frequency=jnp.asarray([[[0.5, 1.0, 1.0], [0.5, 1.0, 0.0]]]),
                       buffer=state.buffer)
  # The walk drew 4, 5, then 3 (stopping): chain 0 is reached at every depth, chain 1 at
  # depth 1 only.
  feedback = Feedback(drawn=jnp.asarray([[4, 5, 3]]), drew=jnp.ones((1, 3), bool),
                      accepted=jnp.asarray([2]), target_ids=jnp.zeros((1, 3, 2), jnp.int32),
                      target_probs=jnp.zeros((1, 3, 2)), path_features=jnp.zeros((1, 4, 8)),
                      levels=3)
  context = StepContext(features=None, root=jnp.asarray([6]), seqs=seqs, vocab=None)
  stats = proposer.observe(None, state, context, Proposal(None, record), feedback).stats
  np.testing.assert_allclose(stats.reached, [4.0])   # chain 0 at 1, 2, 3; chain 1 at 1
  np.testing.assert_allclose(stats.hits, [2.0])
  np.testing.assert_allclose(stats.predicted, [0.5 + 1.0 + 1.0 + 0.5])
  np.testing.assert_allclose(stats.accepted, [2.0])
  np.testing.assert_allclose(stats.matched, [1.0])
  np.testing.assert_allclose(stats.chain_tokens, [5.0])


def test_best_path_value_follows_each_row_parents():
  """A best-first drafter's candidates hang below different parents per row; the value that
  settles a duplicate root is each row's own."""
  rng = np.random.default_rng(0)
  row_parents = np.array([[-1, -1, 0, 0, 2, 2], [-1, -1, 1, 1, 3, 3]])
  scores = rng.uniform(0.05, 1.0, size=(2, 6)).astype(np.float32)
  tokens = np.arange(12, dtype=np.int32).reshape(2, 6)
  value = np.asarray(best_path_value(Candidates(
      tokens=jnp.asarray(tokens), scores=jnp.asarray(scores), parent=(-1, -1, 0, 0, 2, 2),
      row_parents=jnp.asarray(row_parents, jnp.int32))))
  # float32 products of <= 3 scores and sums of <= 3 paths against float64: each operation
  # rounds once, so the values differ by a few float32 ulps (~6e-8 each), well below 1e-6.
  for row in range(2):
    for c in range(6):
      expected = _best_path(tokens[row], scores[row], tuple(row_parents[row]), c)
      assert value[row, c] == pytest.approx(expected, rel=1e-6), (row, c)
