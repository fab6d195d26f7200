"""The drafter comparisons' pairs widened with layer features: every layer sees the prompt."""
import numpy as np
import pytest

from experiments.lib.drafter_recipes import with_layer_features
from specroll_jax.adapt.distill import WarmStart, generated_pairs
from specroll_jax.model.transformer import Transformer


def test_layer_features_are_taken_from_the_whole_sequence(stories_policy):
  """The last layer's output through the final norm is the kept h_t at every valid position,
  which it is only with the prompt in its context (measured: a forward over the span alone is
  off by up to 8.4 in states of magnitude up to 15)."""
  policy = stories_policy
  prompts = [policy.tokenizer.encode(p) for p in ('Once upon a time there was', 'Tom')]
  train, _ = generated_pairs(policy, prompts, WarmStart(num_sequences=4, held_out=2,
                                                        max_new_tokens=12, seed=0), 8)
  rows = [prompts[i % 2] for i in range(4)]
  last = policy.config.num_layers - 1
  wide = with_layer_features(policy, rows, train, (0, last), 'pairs')
  dim = policy.config.hidden_size
  hidden, valid = np.asarray(train.hidden), np.asarray(train.valid)
  np.testing.assert_array_equal(np.asarray(wide.hidden)[..., :dim], hidden)
  normed = np.asarray(Transformer(policy.config).apply(
      {'params': policy.params}, np.asarray(wide.hidden)[..., 2 * dim:],
      method=lambda model, x: model.norm(x)))
  # The same forward's final norm, applied again outside it: a mean of 64 squares in another
  # order moves it by less than 64 float32 ulps (64 * 6e-8 ~ 4e-6 relative).
  np.testing.assert_allclose(normed[valid], hidden[valid], rtol=4e-6, atol=1e-6)
  with pytest.raises(ValueError, match="pairs: pair row 0 does not start at its prompt"):
    with_layer_features(policy, rows[::-1], train, (0,), 'pairs')
