"""Horizon heads: fresh heads, save/load and its errors, and self-distillation."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specroll_jax.adapt import distill
from specroll_jax.spec.heads import (HeadsConfig, HeadsMetadata, apply_heads, heads_metadata,
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
