"""The sequential drafter: its static spine, its training, and its files."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specroll_jax.adapt import drafter_training
from specroll_jax.adapt.distill import WarmStart, generated_pairs
from specroll_jax.adapt.drafter_training import DrafterTraining, train_drafter
from specroll_jax.model.transformer import (Transformer, padded_sequence_features,
                                             padded_sequence_hidden)
from specroll_jax.rollout.driver import Driver, RolloutConfig
from specroll_jax.rollout.sampling import SamplerConfig
from specroll_jax.rollout.sequences import Sequences
from specroll_jax.rollout.vanilla import VanillaEngine
from specroll_jax.speculative.draft_vocabulary import frequency_vocabulary
from specroll_jax.speculative.drafter import (DRAFTER_CONFIG_FILE, DRAFTER_FILE, DrafterConfig,
                                       drafter_step, init_drafter, load_drafter, rms,
                                       save_drafter)
from specroll_jax.speculative.drafter_proposer import DrafterProposer, TreeLayout, spine_paths
from specroll_jax.speculative.engine import SpecEngine
from specroll_jax.speculative.group_proposer import GroupDraftConfig, GroupProposer
from specroll_jax.speculative.proposer import StepContext, Vocabulary
from specroll_jax.speculative.tree import TreeConfig
from tests.speculative.test_speculative_exactness import LOGPROB_ATOL, LOGPROB_RTOL

CONFIG = DrafterConfig(depth=3, hidden_multiplier=1.0, draft_vocab_size=128)


def test_frequency_vocabulary_keeps_the_most_frequent_ids_sorted():
  tokens = np.array([[5, 5, 5, 2, 2, 9, 7, 7]])
  valid = np.array([[True] * 7 + [False]])  # the second 7 is padding: 7 ties 9 once
  assert frequency_vocabulary(tokens, valid, 3, 10).tolist() == [2, 5, 7]
  assert frequency_vocabulary(tokens, valid, 5, 10).tolist() == [0, 2, 5, 7, 9]


def _perturbed_drafter(policy):
  """(draft vocabulary: every fourth id, a drafter over it whose weights are all non-zero)."""
  vocab_ids = np.arange(0, policy.config.vocab_size, 4)
  params = init_drafter(CONFIG, policy.config, vocab_ids, seed=0)
  return vocab_ids, params.replace(weights=jax.tree.map(
      lambda w: w + 0.1 * jax.random.normal(jax.random.key(1), w.shape), params.weights))


def _step_context(policy, batch: int):
  """(hidden [B, D], running sequences, the policy's vocabulary, a step context with roots)."""
  hidden = jax.random.normal(jax.random.key(2), (batch, policy.config.hidden_size))
  seqs = Sequences.empty(jnp.arange(batch), jnp.ones(batch, jnp.int32),
                         jnp.full(batch, 8, jnp.int32), 8, jnp.zeros(batch, bool))
  vocab = Vocabulary(policy.params, policy.config)
  return hidden, seqs, vocab, StepContext(hidden, jnp.array([5, 9]), seqs, vocab)


def test_spine_is_static_and_each_depth_follows_the_best_guess(stories_policy):
  policy = stories_policy
  assert TreeLayout.build(spine_paths((3, 2, 1))).parent == (-1, -1, -1, 0, 0, 3)
  vocab_ids, params = _perturbed_drafter(policy)
  proposer = DrafterProposer(policy.config, CONFIG, spine_paths((3, 2, 1)),
                             SamplerConfig(temperature=1.0))
  assert proposer.num_candidates == 6 and proposer.depth == 3
  batch = 2
  hidden, seqs, vocab, context = _step_context(policy, batch)
  proposal = proposer.propose(params, proposer.init(None, seqs), context, levels=2)
  candidates = proposal.candidates
  assert candidates.tokens.shape == (batch, 6) and candidates.parent == (-1, -1, -1, 0, 0, 3)
  assert np.all(np.isin(np.asarray(candidates.tokens[:, :5]), vocab_ids))
  # Below `levels` nothing is offered.
  assert np.all(np.asarray(candidates.scores[:, 5]) == 0.0)
  # Depth 2 drafts from the state after depth 1's best token.
  z1 = drafter_step(CONFIG, policy.config, params.weights, hidden, vocab.embed(context.root))
  z2 = drafter_step(CONFIG, policy.config, params.weights, z1,
                    vocab.embed(candidates.tokens[:, 0]))
  best2 = vocab_ids[np.argmax(np.asarray(z2 @ vocab.rows(jnp.asarray(vocab_ids)).T), axis=-1)]
  np.testing.assert_array_equal(np.asarray(candidates.tokens[:, 3]), best2)
  # The static layout survives tracing: a proposer traced in two programs (the engine's loop
  # and a pricing loop) proposes the same candidates in both.
  fresh = DrafterProposer(policy.config, CONFIG, spine_paths((3, 2, 1)),
                             SamplerConfig(temperature=1.0))
  for program in (jax.jit(lambda c: fresh.propose(params, None, c, 2).candidates.tokens),
                  jax.jit(lambda c: fresh.propose(params, None, c, 2).candidates.tokens + 0)):
    np.testing.assert_array_equal(np.asarray(program(context)), np.asarray(candidates.tokens))
  with pytest.raises(ValueError, match='exceeds the drafter'):
    DrafterProposer(policy.config, CONFIG, spine_paths((2, 2, 2, 2)), SamplerConfig())


def test_branched_tree_expands_lower_ranks_with_their_own_tokens(stories_policy):
  """A tree that leaves the spine: (1, 0) is the best guess after depth 1's second-ranked
  token, drafted from the block's state after that token, not after the best guess."""
  policy = stories_policy
  paths = ((0,), (1,), (2,), (0, 0), (1, 0), (1, 1), (0, 0, 0), (1, 0, 0))
  layout = TreeLayout.build(reversed(paths))  # any order in, parents first out
  assert layout.paths == paths and layout.parent == (-1, -1, -1, 0, 1, 1, 3, 4)
  assert [list(e) for e in layout.expanded] == [[0, 1], [3, 4]]
  vocab_ids, params = _perturbed_drafter(policy)
  proposer = DrafterProposer(policy.config, CONFIG, paths, SamplerConfig(temperature=1.0))
  batch = 2
  hidden, seqs, vocab, context = _step_context(policy, batch)
  tokens = np.asarray(proposer.propose(params, proposer.init(None, seqs), context,
                                       levels=3).candidates.tokens)
  rows = vocab.rows(jnp.asarray(vocab_ids))
  ranked = lambda z: vocab_ids[np.argsort(-np.asarray(z @ rows.T), axis=-1, kind='stable')]
  step = lambda z, token: drafter_step(CONFIG, policy.config, params.weights, z,
                                       vocab.embed(jnp.asarray(token)))
  z1 = step(hidden, context.root)
  np.testing.assert_array_equal(tokens[:, :3], ranked(z1)[:, :3])
  z_second = step(z1, tokens[:, 1])  # the state after depth 1's rank-1 token
  np.testing.assert_array_equal(tokens[:, 4:6], ranked(z_second)[:, :2])
  np.testing.assert_array_equal(tokens[:, 7], ranked(step(z_second, tokens[:, 4]))[:, 0])
  with pytest.raises(ValueError, match='not prefix-closed'):
    TreeLayout.build(((0,), (1, 0)))


@pytest.fixture(scope='module')
def story_pairs(stories_policy):
  """(training, held-out) pairs over the policy's own stories."""
  plan = WarmStart(num_sequences=24, held_out=8, max_new_tokens=48, seed=0)
  return generated_pairs(stories_policy, [[stories_policy.config.bos_token_id]], plan, 16)


def test_soft_target_training_lowers_held_out_loss(stories_policy, story_pairs):
  policy = stories_policy
  train, held = story_pairs
  training = DrafterTraining(target_top_k=16, steps=60, batch_size=8, learning_rate=3e-3)

  def held_out(params):
    loss, count = drafter_training.depth_losses(CONFIG, policy.config, params, policy.params,
                                                held)
    mass = drafter_training.agreement_rates(CONFIG, policy.config, params, policy.params,
                                            held)[1]
    return np.asarray(loss) / np.asarray(count), mass

  vocab = frequency_vocabulary(train.tokens, train.valid, CONFIG.vocab_size(policy.config),
                               policy.config.vocab_size)
  fresh = init_drafter(CONFIG, policy.config, vocab, seed=0)
  trained, _ = train_drafter(policy, CONFIG, training, train, seed=0, init_params=fresh)
  (loss_before, mass_before), (loss_after, mass_after) = held_out(fresh), held_out(trained)
  assert np.all(loss_after < loss_before), (loss_before, loss_after)
  assert mass_after[0] > mass_before[0] + 0.05, (mass_before, mass_after)
  # Rank 0 of the drawn token is top-1 agreement, counted the same way.
  ranks = np.asarray(drafter_training.drawn_ranks(CONFIG, policy.config, trained, policy.params,
                                                  held, 8))
  top1 = drafter_training.agreement_rates(CONFIG, policy.config, trained, policy.params, held)[0]
  valid = np.asarray(held.valid)
  for d in range(1, CONFIG.depth + 1):  # depth d drafts x_{t+d+1}
    real = valid & np.pad(valid[:, d + 1:], ((0, 0), (0, d + 1)))
    np.testing.assert_allclose(np.mean(ranks[..., d - 1][real] == 0), top1[d - 1], rtol=1e-6)


def test_feature_loss_pulls_the_states_onto_the_policy_hidden_states(stories_policy,
                                                                      story_pairs):
  """The same data, batches and start with and without the feature term: with it, every
  depth's held-out state lies nearer the policy's own hidden state there."""
  policy = stories_policy
  train, held = story_pairs
  distances = []
  for weight in (0.0, 1.0):
    training = DrafterTraining(target_top_k=16, steps=40, batch_size=8, learning_rate=3e-3,
                               feature_weight=weight)
    params, _ = train_drafter(policy, CONFIG, training, train, seed=0)
    distances.append(np.asarray(drafter_training.feature_distances(
        CONFIG, policy.config, params, policy.params, held)))
  assert np.all(distances[1] < distances[0]), distances


def test_saved_drafter_loads_and_bad_files_are_named(stories_policy, tmp_path):
  policy = stories_policy
  params = init_drafter(CONFIG, policy.config, np.arange(128), seed=0)
  save_drafter(tmp_path / 'd', CONFIG, params)
  config, loaded = load_drafter(tmp_path / 'd', policy.config)
  assert config == CONFIG
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(loaded)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # A heads directory is not a drafter.
  (tmp_path / 'heads').mkdir()
  with pytest.raises(FileNotFoundError, match=DRAFTER_CONFIG_FILE):
    load_drafter(tmp_path / 'heads', policy.config)
  # A draft vocabulary of another size than the config's.
  record = json.loads((tmp_path / 'd' / DRAFTER_CONFIG_FILE).read_text())
  record['drafter']['draft_vocab_size'] = 64
  (tmp_path / 'd' / DRAFTER_CONFIG_FILE).write_text(json.dumps(record))
  with pytest.raises(ValueError, match="'draft_vocab' has shape \\(128,\\)"):
    load_drafter(tmp_path / 'd', policy.config)
  # Another policy's hidden size.
  wide = init_drafter(CONFIG, dataclasses.replace(policy.config,
                                               hidden_size=2 * policy.config.hidden_size),
                      np.arange(128), seed=0)
  save_drafter(tmp_path / 'w', CONFIG, wide)
  with pytest.raises(ValueError, match=r'has shape .* this policy \(hidden_size='):
    load_drafter(tmp_path / 'w', policy.config)
  (tmp_path / 'w' / DRAFTER_FILE).write_bytes(b'truncated')
  with pytest.raises(ValueError, match='not a readable safetensors'):
    load_drafter(tmp_path / 'w', policy.config)


def test_best_first_tree_expands_each_row_most_probable_paths(stories_policy):
  """expanded=(2, 2): each row expands the two depth-1 and the two depth-2 candidates of
  highest path probability under the drafter, drafted from their own states; expanding one
  per depth is the spine, bit for bit."""
  policy = stories_policy
  vocab_ids, params = _perturbed_drafter(policy)
  sampler = SamplerConfig(temperature=1.0)
  proposer = DrafterProposer(policy.config, CONFIG, spine_paths((3, 2, 2)), sampler,
                             expanded=(2, 2))
  assert proposer.level_counts == (3, 4, 4) and proposer.num_candidates == 11
  assert proposer.template_parents == (-1, -1, -1, 0, 0, 1, 1, 3, 3, 4, 4)
  batch = 2
  hidden, seqs, vocab, context = _step_context(policy, batch)
  candidates = proposer.propose(params, proposer.init(None, seqs), context, levels=3).candidates
  tokens, scores = np.asarray(candidates.tokens), np.asarray(candidates.scores)
  parents = np.asarray(candidates.parents())
  rows = vocab.rows(jnp.asarray(vocab_ids))
  law = lambda z: np.asarray(jax.nn.softmax(z @ rows.T, axis=-1))
  step = lambda z, token: drafter_step(CONFIG, policy.config, params.weights, z[None],
                                       vocab.embed(jnp.asarray([token])))[0]
  for b in range(batch):
    z1 = step(hidden[b], int(context.root[b]))
    order = np.argsort(-law(z1), kind='stable')[:3]
    np.testing.assert_array_equal(tokens[b, :3], vocab_ids[order])
    path = {c: scores[b, c] for c in range(3)}
    state = {c: step(z1, tokens[b, c]) for c in range(2)}  # the two best depth-1 paths
    for c in range(3, 7):
      parent = parents[b, c]
      assert parent == (c - 3) // 2  # depth 1 is ranked already: slot s expands rank s
      probs = law(state[parent])
      np.testing.assert_array_equal(tokens[b, c], vocab_ids[np.argsort(-probs)[(c - 3) % 2]])
      path[c] = path[parent] * scores[b, c]
    best = sorted(range(3, 7), key=lambda c: -path[c])[:2]
    assert parents[b, 7:].tolist() == [best[0]] * 2 + [best[1]] * 2
    for c in range(7, 11):
      z = step(state[parents[b, parents[b, c]]], tokens[b, parents[b, c]])
      np.testing.assert_array_equal(
          tokens[b, c], vocab_ids[np.argsort(-law(z))[(c - 7) % 2]])
  spine = DrafterProposer(policy.config, CONFIG, spine_paths((3, 2, 2)), sampler)
  one_each = dataclasses.replace(spine, expanded=(1, 1))
  for levels in (2, 3):
    a, b = (p.propose(params, p.init(None, seqs), context, levels).candidates
            for p in (spine, one_each))
    for x, y in ((a.tokens, b.tokens), (a.scores, b.scores), (a.parents(), b.parents())):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  with pytest.raises(ValueError, match='grows from a spine'):
    DrafterProposer(policy.config, CONFIG, ((0,), (1,), (1, 0)), sampler, expanded=(1,))
  with pytest.raises(ValueError, match='one count per depth'):
    DrafterProposer(policy.config, CONFIG, spine_paths((3, 2, 2)), sampler, expanded=(4, 1))


def test_a_drafter_reading_layer_features_trains_and_saves(stories_policy, story_pairs,
                                                            tmp_path):
  """Pairs with layer features hold the final hidden state first; a fresh fusion reads that
  part alone; training with them lowers the loss; the fusion's weights round-trip."""
  policy = stories_policy
  last = policy.config.num_layers - 1
  train = story_pairs[0]
  tokens = jnp.where(train.valid, train.tokens, -1)
  features = padded_sequence_features(policy.config, policy.params, tokens, (0, last))
  dim = policy.config.hidden_size
  hidden = padded_sequence_hidden(policy.config, policy.params, tokens)[0]
  np.testing.assert_array_equal(np.asarray(features[..., :dim]), np.asarray(hidden))
  # The last layer's output through the final norm is the final state. Outside the forward
  # the norm's mean of 64 squares may be summed in another order: each partial sum rounds
  # once, so the relative difference stays below 64 float32 ulps (64 * 6e-8 ~ 4e-6).
  final_norm = Transformer(policy.config).apply(
      {'params': policy.params}, features[..., 2 * dim:],
      method=lambda model, x: model.norm(x))
  valid = np.asarray(train.valid)
  np.testing.assert_allclose(np.asarray(final_norm)[valid], np.asarray(hidden)[valid],
                             rtol=4e-6, atol=1e-6)
  config = dataclasses.replace(CONFIG, feature_layers=(0, last))
  vocab = frequency_vocabulary(train.tokens, train.valid, config.vocab_size(policy.config),
                               policy.config.vocab_size)
  fresh = init_drafter(config, policy.config, vocab, seed=0)
  np.testing.assert_array_equal(
      np.asarray(config.first_state(policy.config, fresh.weights, features)),
      np.asarray(rms(hidden, policy.config.rms_norm_eps)))
  wide = train.replace(hidden=features)
  trained, _ = train_drafter(policy, config, DrafterTraining(target_top_k=16, steps=20,
                                                             batch_size=8, learning_rate=3e-3),
                             wide, seed=0, init_params=fresh)
  losses = lambda p: np.divide(*map(np.asarray, drafter_training.depth_losses(
      config, policy.config, p, policy.params, wide)))
  assert np.all(losses(trained) < losses(fresh))
  save_drafter(tmp_path, config, trained)
  loaded_config, loaded = load_drafter(tmp_path, policy.config)
  assert loaded_config == config
  np.testing.assert_array_equal(np.asarray(loaded.weights['features']['project']['kernel']),
                                np.asarray(trained.weights['features']['project']['kernel']))


def test_the_engine_hands_a_feature_drafter_a_full_forward_s_features_and_stays_exact(
    stories_policy):
  """After the prefill, tree steps and plain steps, each row's features (h_t, then layers 0
  and 4) are those of one forward over its prompt and response at its last token; with
  such a drafter under group drafts, rollouts are vanilla's."""
  policy = stories_policy
  layers = (0, policy.config.num_layers - 1)
  config = dataclasses.replace(CONFIG, feature_layers=layers)
  fresh = init_drafter(config, policy.config, np.arange(0, policy.config.vocab_size, 4), seed=0)
  params = fresh.replace(weights=jax.tree.map(
      lambda w: w + 0.1 * jax.random.normal(jax.random.key(1), w.shape), fresh.weights))
  sampler = SamplerConfig(temperature=1.0)
  drafter = DrafterProposer(policy.config, config, spine_paths((2, 2, 1)), sampler)
  proposer = GroupProposer(GroupDraftConfig(chains=2, chain_depth=3, min_match=1), base=drafter)
  assert proposer.feature_layers == layers
  engine = SpecEngine(policy.config, proposer, TreeConfig(capacity_tokens=16, max_nodes=8),
                      sampler, ())
  engine_params = engine.params(policy.params, params)
  prompts = [policy.tokenizer.encode(t) for t in ('Once upon a time', 'The cat')]
  state = Driver(engine, RolloutConfig(max_new_tokens=16, max_batch=2)).first_state(
      engine_params, prompts, 1)
  dim, key = policy.config.hidden_size, jax.random.key(0)
  tree_step, plain_step = jax.jit(engine.tree_step), jax.jit(engine.plain_step)
  for step in (None, tree_step, tree_step, plain_step, plain_step, tree_step):
    state = state if step is None else step(engine_params, state, key)
    for b, prompt in enumerate(prompts):
      n = int(state.seqs.num_generated[b])
      tokens = jnp.asarray([prompt + np.asarray(state.seqs.tokens[b, :n]).tolist()])
      full = np.asarray(padded_sequence_features(policy.config, policy.params, tokens,
                                                 layers)[0, -1])
      got = np.asarray(state.last_features[b])
      # The same sums in other orders (one token, or a tree block over the cache, against
      # a causal pass over the whole row): measured at most 1.4e-6 of a part's largest
      # magnitude (1.8e-5 at 12.7, 14 checks); 1e-5 is ~80 float32 ulps of it, the
      # rounding of 5 layers of 64-term dots and attention sums over <= 24 keys.
      for part in range(1 + len(layers)):
        at = slice(part * dim, (part + 1) * dim)
        np.testing.assert_allclose(got[at], full[at], rtol=0,
                                   atol=1e-5 * np.abs(full[at]).max())
  config = RolloutConfig(max_new_tokens=24, max_batch=4)
  prompts = prompts + [policy.tokenizer.encode('Hi')]
  vanilla = Driver(VanillaEngine(policy.config, sampler, (2,)), config).generate(
      policy.params, prompts, 2, 11)
  engine = dataclasses.replace(engine, eos_ids=(2,))
  spec = Driver(engine, config).generate(engine_params, prompts, 2, 11)
  assert [r.token_ids for r in spec] == [r.token_ids for r in vanilla]
  for a, b in zip(spec, vanilla):
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=LOGPROB_ATOL, rtol=LOGPROB_RTOL)
  assert sum(float(r.stats.tree.accepted.sum()) for r in spec) > 0
