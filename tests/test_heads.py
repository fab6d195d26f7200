"""Horizon heads: fresh heads, save/load and its errors, and self-distillation."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specroll_jax.adapt import distill
from specroll_jax.speculative.heads import (HeadsConfig, HeadsMetadata, apply_heads, heads_metadata,
                                     init_heads, load_heads, save_heads)


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
