"""Horizon heads: fresh heads, save/load and its errors, and self-distillation, over the whole
vocabulary and over a draft vocabulary."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specroll_jax.adapt import distill
from specroll_jax.rollout.sampling import SamplerConfig
from specroll_jax.rollout.sequences import Sequences
from specroll_jax.speculative.head_proposer import HeadDraftConfig, HeadProposer
from specroll_jax.speculative.heads import (HEADS_CONFIG_FILE, HEADS_FILE, HeadsConfig,
                                     HeadsMetadata, apply_heads, heads_metadata, init_heads,
                                     load_heads, save_heads)
from specroll_jax.speculative.proposer import StepContext, Vocabulary


def test_fresh_heads_propose_the_next_token_distribution(stories_policy):
  config = HeadsConfig(num_heads=3)
  params = init_heads(config, stories_policy.config)
  hidden = jax.random.normal(jax.random.key(0), (5, 64))
  z = apply_heads(config, stories_policy.config, params, hidden)
  assert z.shape == (5, 3, 64)
  np.testing.assert_array_equal(z, jnp.broadcast_to(hidden[:, None], z.shape))


def test_save_load_round_trip_and_errors(tmp_path, stories_policy):
  config = HeadsConfig(num_heads=2, hidden_multiplier=0.5)
  params = init_heads(config, stories_policy.config, seed=3)
  metadata = HeadsMetadata(source='test', num_sequences=4, max_new_tokens=8, temperature=1.0,
                           steps=2, final_loss=1.5, rank_hit_rate=[[0.5, 0.25]])
  save_heads(tmp_path / 'h', config, params, metadata)
  loaded_config, loaded = load_heads(tmp_path / 'h', stories_policy.config)
  assert loaded_config == config
  assert heads_metadata(tmp_path / 'h') == metadata
  jax.tree.map(np.testing.assert_array_equal, loaded, params)
  with pytest.raises(FileNotFoundError, match='heads_config.json'):
    load_heads(tmp_path / 'missing', stories_policy.config)
  wide = stories_policy.config.__class__(**{**stories_policy.config.__dict__, 'hidden_size': 32})
  with pytest.raises(ValueError, match="tensor 'norm' has shape"):
    load_heads(tmp_path / 'h', wide)


def test_distillation_improves_heads_and_leaves_the_policy_alone(stories_policy):
  policy = stories_policy
  heads_config = HeadsConfig(num_heads=2)
  config = distill.DistillConfig(steps=40, batch_size=8, learning_rate=1e-2)
  rng = np.random.default_rng(0)
  # A repeating pattern: the token two ahead is a deterministic function of the current one.
  sequences = [[1] + list(np.tile(rng.permutation(np.arange(300, 310)), 5)) for _ in range(16)]
  batch = distill.stack_batches(policy.config, policy.params, sequences, 52, 8)
  before = float(distill.distill_loss(heads_config, policy.config, config,
                                      init_heads(heads_config, policy.config), policy.params,
                                      batch))
  policy_before = jax.tree.map(np.array, policy.params)
  params, after = distill.train_heads(policy, heads_config, config, batch)
  assert after < 0.7 * before
  jax.tree.map(np.testing.assert_array_equal, policy.params, policy_before)


def _dense_head_losses(heads_config, model_config, head_params, policy_params, batch):
  """The plain reference: every head's full-vocabulary log-softmax at every position."""
  from specroll_jax.model.transformer import Transformer
  z = apply_heads(heads_config, model_config, head_params, batch.hidden)
  logq = jax.nn.log_softmax(Transformer(model_config).apply(
      {'params': policy_params}, z, method=Transformer.project), axis=-1)
  width = batch.tokens.shape[1]
  kls, ces, counts = [], [], []
  for k in range(1, heads_config.num_heads + 1):
    lq = logq[:, :width - k - 1, k - 1]
    target_logp = batch.target_logp[:, k:width - 1]
    mask = batch.valid[:, k + 1:] & batch.valid[:, :width - k - 1]
    kl = jnp.sum(jnp.exp(target_logp) * (
        target_logp - jnp.take_along_axis(lq, batch.target_ids[:, k:width - 1], axis=-1)), -1)
    ce = -jnp.take_along_axis(lq, batch.tokens[:, k + 1:, None], axis=-1)[..., 0]
    kls.append(jnp.sum(jnp.where(mask, kl, 0.0)))
    ces.append(jnp.sum(jnp.where(mask, ce, 0.0)))
    counts.append(jnp.sum(mask))
  return jnp.stack(kls), jnp.stack(ces), jnp.stack(counts)


def test_streamed_head_losses_and_gradients_equal_the_dense_reference(stories_policy,
                                                                      monkeypatch):
  from specroll_jax.model import vocab_chunks
  policy = stories_policy
  heads_config = HeadsConfig(num_heads=3)
  params = init_heads(heads_config, policy.config, seed=1)
  params = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(2), x.shape),
                        params)
  rng = np.random.default_rng(0)
  sequences = [list(rng.integers(3, 500, n)) for n in (20, 13, 17)]  # ragged: padding masked
  # 7 rows of 512 logits per chunk: 3 x 24 x 3 rows need 31 chunks, the last one padded.
  monkeypatch.setattr(vocab_chunks, 'MAX_CHUNK_LOGITS', 7 * policy.config.vocab_size)
  batch = distill.build_batch(policy.config, policy.params, sequences, 24, 8)
  streamed = lambda p: distill.head_losses(heads_config, policy.config, p, policy.params, batch)
  dense = lambda p: _dense_head_losses(heads_config, policy.config, p, policy.params, batch)
  for got, want in zip(streamed(params), dense(params)):
    np.testing.assert_allclose(got, want, rtol=1e-5)
  total = lambda losses: lambda p: jnp.sum(losses(p)[0] + losses(p)[1])
  jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6),
               jax.grad(total(streamed))(params), jax.grad(total(dense))(params))


def _draft_heads(policy, num_heads=2):
  """Heads over every third token id, with trained-looking (non-zero) output weights."""
  config = HeadsConfig(num_heads=num_heads,
                       draft_vocab=tuple(range(1, policy.config.vocab_size, 3)))
  params = init_heads(config, policy.config, seed=1)
  return config, dict(params, w2=0.3 * jax.random.normal(jax.random.key(2), params['w2'].shape))


def test_draft_vocabulary_heads_save_load_and_old_files(tmp_path, stories_policy):
  policy = stories_policy
  config, params = _draft_heads(policy)
  save_heads(tmp_path / 'h', config, params)
  loaded_config, loaded = load_heads(tmp_path / 'h', policy.config)
  assert loaded_config == config and len(loaded_config.draft_vocab) == 171
  jax.tree.map(np.testing.assert_array_equal, loaded, params)
  # A file from before draft vocabularies (no size in the record, no tensor) is a
  # whole-vocabulary head and loads as one.
  whole = HeadsConfig(num_heads=2)
  save_heads(tmp_path / 'old', whole, params)
  record_path = tmp_path / 'old' / HEADS_CONFIG_FILE
  record = json.loads(record_path.read_text())
  del record['heads']['draft_vocab_size']
  record_path.write_text(json.dumps(record))
  assert load_heads(tmp_path / 'old', policy.config)[0] == whole
  # A record that promises a vocabulary its weights file lacks names the file and tensor.
  record['heads']['draft_vocab_size'] = 171
  record_path.write_text(json.dumps(record))
  with pytest.raises(ValueError, match=f"{HEADS_FILE}: tensor 'draft_vocab' has shape None"):
    load_heads(tmp_path / 'old', policy.config)
  # Ids this policy does not have.
  small = dataclasses.replace(policy.config, vocab_size=300)
  with pytest.raises(ValueError, match="'draft_vocab' holds ids outside this policy's "
                                       "vocabulary of 300"):
    load_heads(tmp_path / 'h', small)


def test_draft_vocabulary_head_losses_equal_a_dense_reference(stories_policy):
  """Restricted to the draft vocabulary: log q is the log-softmax over W[vocab] z, and the
  policy's targets outside the vocabulary (and realised tokens outside it) score nothing."""
  from specroll_jax.model.transformer import Transformer
  policy = stories_policy
  config, params = _draft_heads(policy, num_heads=3)
  vocab = np.asarray(config.draft_vocab)
  rng = np.random.default_rng(0)
  sequences = [list(rng.integers(3, 500, n)) for n in (20, 13, 17)]
  batch = distill.build_batch(policy.config, policy.params, sequences, 24, 8)

  def dense(p):
    z = apply_heads(config, policy.config, p, batch.hidden)
    logits = Transformer(policy.config).apply({'params': policy.params}, z,
                                              method=Transformer.project)
    # Outside the vocabulary: -inf logits, so log-softmax over the vocabulary's columns.
    allowed = np.zeros(policy.config.vocab_size, bool)
    allowed[vocab] = True
    logq = jax.nn.log_softmax(jnp.where(allowed, logits, -jnp.inf), axis=-1)
    width = batch.tokens.shape[1]
    kls, ces = [], []
    for k in range(1, config.num_heads + 1):
      lq = logq[:, :width - k - 1, k - 1]
      ids, target_logp = batch.target_ids[:, k:width - 1], batch.target_logp[:, k:width - 1]
      mask = batch.valid[:, k + 1:] & batch.valid[:, :width - k - 1]
      terms = jnp.exp(target_logp) * (target_logp - jnp.take_along_axis(lq, ids, axis=-1))
      kl = jnp.sum(jnp.where(allowed[ids], terms, 0.0), -1)
      realised = batch.tokens[:, k + 1:]
      ce = jnp.where(allowed[realised],
                     -jnp.take_along_axis(lq, realised[..., None], axis=-1)[..., 0], 0.0)
      kls.append(jnp.sum(jnp.where(mask, kl, 0.0)))
      ces.append(jnp.sum(jnp.where(mask, ce, 0.0)))
    return jnp.stack(kls), jnp.stack(ces)

  restricted = lambda p: distill.head_losses(config, policy.config, p, policy.params, batch)
  got, want = restricted(params), dense(params)
  # The targets really straddle the vocabulary's edge, so the masking is exercised.
  inside = np.isin(np.asarray(batch.target_ids), vocab)
  assert 0.1 < inside.mean() < 0.9
  for g, w in zip(got[:2], want):
    np.testing.assert_allclose(g, w, rtol=1e-5)
  total = lambda losses: lambda p: jnp.sum(losses(p)[0] + losses(p)[1])
  jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6),
               jax.grad(total(restricted))(params), jax.grad(total(dense))(params))
  # Held-out ranks are read over the vocabulary too: every guess is a vocabulary token.
  hits, counts = distill.rank_hits(config, policy.config, params, policy.params, 4, batch)
  assert hits.shape == (3, 4) and np.all(np.asarray(hits) <= np.asarray(counts)[:, None])


def test_draft_vocabulary_heads_propose_only_vocabulary_tokens(stories_policy):
  policy = stories_policy
  config, params = _draft_heads(policy)
  sampler = SamplerConfig(temperature=1.0)
  proposer = HeadProposer(policy.config, config, HeadDraftConfig((4, 2)), sampler)
  batch = 3
  hidden = jax.random.normal(jax.random.key(4), (batch, policy.config.hidden_size))
  seqs = Sequences.empty(jnp.arange(batch), jnp.ones(batch, jnp.int32),
                         jnp.full(batch, 8, jnp.int32), 8, jnp.zeros(batch, bool))
  vocab = Vocabulary(policy.params, policy.config)
  context = StepContext(hidden, jnp.array([5, 9, 11]), seqs, vocab)
  guesses = proposer.guesses(proposer.head_states(params, hidden, 2), context)
  assert np.all(np.isin(np.asarray(guesses.tokens), config.draft_vocab))
  # Each depth's probabilities are the sampler's over the vocabulary's columns alone.
  z = apply_heads(config, policy.config, params, hidden)[:, 0]
  logits = vocab.logits(z)[:, np.asarray(config.draft_vocab)]
  want = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), 4)[0]
  np.testing.assert_allclose(guesses.probs[:, 0], want, rtol=1e-5)
