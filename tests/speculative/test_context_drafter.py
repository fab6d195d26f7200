"""The context-attending drafter: drafting equals training's teacher-forced pass, its cache holds
exactly the accepted tokens, the engine stays exact with it, training teaches it, its files."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specroll_jax.adapt import drafter_training
from specroll_jax.adapt.distill import WarmStart, generated_pairs
from specroll_jax.adapt.drafter_training import DrafterTraining, train_drafter
from specroll_jax.model.transformer import padded_sequence_hidden
from specroll_jax.rollout import sampling
from specroll_jax.rollout.driver import Driver, RolloutConfig
from specroll_jax.rollout.sampling import SamplerConfig
from specroll_jax.rollout.sequences import Sequences
from specroll_jax.rollout.vanilla import VanillaEngine
from specroll_jax.speculative.context_drafter import (CONTEXT_DRAFTER_FILE,
                                                      ContextDrafterConfig)
from specroll_jax.speculative.context_drafter_proposer import ContextDrafterProposer
from specroll_jax.speculative.drafter import (DrafterConfig, has_drafter, init_drafter,
                                              load_drafter, save_drafter)
from specroll_jax.speculative.drafter_proposer import spine_paths
from specroll_jax.speculative.engine import SpecEngine
from specroll_jax.speculative.proposer import Feedback, StepContext, Vocabulary
from specroll_jax.speculative.tree import TreeConfig
from tests.speculative.test_speculative_exactness import LOGPROB_ATOL, LOGPROB_RTOL

CONFIG = ContextDrafterConfig(depth=3, hidden_multiplier=1.0, draft_vocab_size=128,
                              num_heads=2)
# Every depth's best guess and the next ranks: the law's top 3 at depths 1 and 2.
PATHS = spine_paths((3, 3, 1))


def _with_layers(policy):
  """CONFIG fusing the first and the last decoder layers' outputs with h_t."""
  return dataclasses.replace(CONFIG, feature_layers=(0, policy.config.num_layers - 1))


def _perturbed(policy, seed=1, config=CONFIG):
  """A layer over every other token id whose weights are all non-zero (zero-initialised
  outputs would make attention invisible; an unperturbed fusion would read h_t alone)."""
  vocab_ids = np.arange(0, 2 * config.draft_vocab_size, 2)
  params = init_drafter(config, policy.config, vocab_ids, seed=0)
  leaves, tree = jax.tree.flatten(params.weights)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  noisy = [w + 0.3 * jax.random.normal(k, w.shape) for w, k in zip(leaves, keys)]
  return params.replace(weights=jax.tree.unflatten(tree, noisy))


def _context(policy, hidden, root, n, length):
  seqs = Sequences.empty(jnp.zeros(1, jnp.int32), jnp.ones(1, jnp.int32),
                         jnp.full(1, length, jnp.int32), length, jnp.zeros(1, bool))
  seqs = seqs.replace(num_generated=jnp.full(1, n, jnp.int32))
  return StepContext(hidden[None], jnp.asarray([root], jnp.int32), seqs,
                     Vocabulary(policy.params, policy.config))


@pytest.mark.parametrize('layers', [False, True], ids=['h_t', 'layer-features'])
def test_drafts_equal_the_teacher_forced_pass_over_the_accepted_path(stories_policy, layers):
  """Steps accept 2, 0 and 1 nodes (writing entries 0-2, 3, 4-5 of a random response);
  the next step's spine drafts, depth by depth, the law that training's parallel pass
  computes at that position along the same tokens: the cache holds exactly the accepted
  tokens' entries and the chain reads what training's chain reads; with layer features,
  the root and the entries fuse the layers' outputs at their own positions."""
  policy, length = stories_policy, 12
  config = _with_layers(policy) if layers else CONFIG
  depth = config.depth
  params = _perturbed(policy, config=config)
  proposer = ContextDrafterProposer(policy.config, config, PATHS, SamplerConfig(temperature=1.0))
  rng = np.random.default_rng(0)
  prompt = [policy.config.bos_token_id] + rng.integers(3, 200, 3).tolist()
  response = rng.integers(3, 200, 8).tolist()
  tokens = jnp.asarray([prompt + response], jnp.int32)
  # Span index j = position len(prompt) - 1 + j: entry j pairs h_j with x_{j+1}.
  hidden = padded_sequence_hidden(policy.config, policy.params, tokens,
                                  config.feature_layers)[0][0, len(prompt) - 1:]
  span = prompt[-1:] + response
  state = proposer.init(jnp.asarray([prompt]), _context(policy, hidden[0], 0, 0, length).seqs)
  n = 0
  for accepted in (2, 0, 1):
    context = _context(policy, hidden[n], span[n + 1], n, length)
    proposal = proposer.propose(params, state, context, depth)
    drawn = [span[min(n + 2 + i, len(span) - 1)] for i in range(depth)]
    path = jnp.stack([hidden[min(n + 1 + i, len(span) - 1)] for i in range(depth + 1)])
    feedback = Feedback(drawn=jnp.asarray([drawn]), drew=jnp.ones((1, depth), bool),
                        accepted=jnp.asarray([accepted]),
                        target_ids=jnp.zeros((1, depth, 0), jnp.int32),
                        target_probs=jnp.zeros((1, depth, 0)), path_features=path[None],
                        levels=depth)
    state = proposer.observe(params, state, context, proposal, feedback)
    n += accepted + 1
  assert n == 6
  np.testing.assert_array_equal(np.asarray(state.filled[0]), np.arange(length) < n)
  context = _context(policy, hidden[n], span[n + 1], n, length)
  candidates = proposer.propose(params, state, context, depth).candidates
  # The path the spine drafts: the root, then each depth's best guess.
  guesses = [int(candidates.tokens[0, PATHS.index((0,) * d)]) for d in range(1, depth)]
  rows = Vocabulary(policy.params, policy.config).rows(params.vocab_ids)
  padded = jnp.concatenate([hidden[:n + 1], jnp.zeros((depth, hidden.shape[1]))])[None]

  def teacher_forced(drafted):
    """Training's states along the root and `drafted` tokens below it."""
    path_tokens = jnp.asarray([span[:n + 2] + drafted], jnp.int32)
    embedded = Vocabulary(policy.params, policy.config).embed(path_tokens)
    return config.teacher_forced_states(policy.config, params.weights, padded, embedded,
                                        jnp.ones(path_tokens.shape, bool))

  states = teacher_forced(guesses)
  # A best-first tree (the two most probable paths expanded per depth) drafts each depth-3
  # candidate from its own path's chain: training's law along that path.
  best_first = ContextDrafterProposer(policy.config, config, PATHS, proposer.sampler,
                                      expanded=(2, 2))
  grown = best_first.propose(params, state, context, depth).candidates
  parents = np.asarray(grown.parents()[0])
  for c in range(9, 11):
    drafted = [int(grown.tokens[0, parents[parents[c]]]), int(grown.tokens[0, parents[c]])]
    law = sampling.distribution(teacher_forced(drafted)[-1][0, n] @ rows.T, proposer.sampler)
    assert int(grown.tokens[0, c]) == int(params.vocab_ids[jnp.argmax(law)])
  for d, z in enumerate(states, start=1):
    law = sampling.distribution(z[0, n] @ rows.T, proposer.sampler)
    probs, index = jax.lax.top_k(law, 3 if d < depth else 1)
    at = [PATHS.index((0,) * (d - 1) + (r,)) for r in range(probs.shape[0])]
    np.testing.assert_array_equal(np.asarray(candidates.tokens[0, at]),
                                  np.asarray(params.vocab_ids[index]))
    # Two float32 orders of the same sums (the cache's 12 slots, the empty ones at exactly 0
    # weight, against training's 9 causal positions, and differently shaped projections):
    # logits of magnitude ~10 differ by a few ulps (~1e-6 each), which moves a probability p
    # by about p times that. Measured: 1.5e-7, 2.2e-7, 1.0e-6 at depths 1-3.
    np.testing.assert_allclose(np.asarray(candidates.scores[0, at]), np.asarray(probs),
                               rtol=0, atol=2e-6)


@pytest.mark.parametrize('sampler,capacity,expanded,layers', [
    (SamplerConfig(temperature=0.0), 16, (), False),
    (SamplerConfig(temperature=1.0), 64, (), False),
    (SamplerConfig(temperature=1.0), 64, (2, 2), False),
    (SamplerConfig(temperature=1.0), 64, (2, 2), True)],
    ids=['greedy', 'T=1', 'T=1-best-first', 'T=1-best-first-layer-features'])
def test_speculative_with_the_context_drafter_equals_vanilla(stories_policy, sampler, capacity,
                                                            expanded, layers):
  """A layer of noise over half the vocabulary (it proposes, it is rarely right) in rows
  that finish at different lengths, on a static tree or one grown best-first per row,
  reading h_t or layer features: tokens and log-probs are vanilla's."""
  policy = stories_policy
  config = _with_layers(policy) if layers else CONFIG
  paths = spine_paths((4, 2, 2)) + (() if expanded else ((1, 0), (1, 1)))
  proposer = ContextDrafterProposer(policy.config, config, paths, sampler, expanded=expanded)
  engine = SpecEngine(policy.config, proposer, TreeConfig(capacity_tokens=capacity,
                                                          max_nodes=16), sampler, (2,))
  rollout = RolloutConfig(max_new_tokens=40, max_batch=8)
  prompts = [policy.tokenizer.encode(p) for p in ('Once upon a time', 'The cat sat on', 'Hi')]
  vanilla = Driver(VanillaEngine(policy.config, sampler, (2,)), rollout).generate(
      policy.params, prompts, 2, 11)
  spec = Driver(engine, rollout).generate(
      engine.params(policy.params, _perturbed(policy, config=config)), prompts, 2, 11)
  assert [r.token_ids for r in spec] == [r.token_ids for r in vanilla]
  for a, b in zip(spec, vanilla):
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=LOGPROB_ATOL, rtol=LOGPROB_RTOL)


def test_training_lowers_held_out_loss_and_files_round_trip(stories_policy, tmp_path):
  policy = stories_policy
  plan = WarmStart(num_sequences=16, held_out=8, max_new_tokens=32, seed=0)
  train, held = generated_pairs(policy, [[policy.config.bos_token_id]], plan, 16)
  fresh = init_drafter(CONFIG, policy.config, np.arange(CONFIG.draft_vocab_size), seed=0)
  trained, _ = train_drafter(policy, CONFIG, DrafterTraining(target_top_k=16, steps=40,
                                                             batch_size=8, learning_rate=3e-3),
                             train, seed=0, init_params=fresh)
  loss = lambda p: np.divide(*map(np.asarray, drafter_training.depth_losses(
      CONFIG, policy.config, p, policy.params, held)))
  assert np.all(loss(trained) < loss(fresh)), (loss(fresh), loss(trained))
  save_drafter(tmp_path, CONFIG, trained)
  assert (tmp_path / CONTEXT_DRAFTER_FILE).is_file()
  assert has_drafter(tmp_path, ContextDrafterConfig) and not has_drafter(tmp_path)
  config, loaded = load_drafter(tmp_path, policy.config, ContextDrafterConfig)
  assert config == CONFIG
  for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(loaded)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  with pytest.raises(FileNotFoundError, match='drafter_config.json'):
    load_drafter(tmp_path, policy.config, DrafterConfig)
