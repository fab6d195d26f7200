"""The sampler draws from softmax(logits / T) after top-k and top-p (chi-square, fixed seed)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.scipy.special import gammaincc

from specroll_jax.rollout import sampling
from specroll_jax.rollout.sampling import SamplerConfig

DRAWS = 40000


def _expected_probs(logits: np.ndarray, sampler: SamplerConfig) -> np.ndarray:
  """Independent numpy statement of the filtered distribution."""
  x = logits.astype(np.float64) / sampler.temperature
  order = np.argsort(-x)
  keep = np.zeros_like(x, bool)
  keep[order[:sampler.top_k or len(x)]] = True
  p = np.where(keep, np.exp(x - x.max()), 0.0)
  p /= p.sum()
  if sampler.top_p < 1.0:
    sorted_p = p[order]
    before = np.cumsum(sorted_p) - sorted_p
    nucleus = np.zeros_like(keep)
    nucleus[order[before < sampler.top_p]] = True
    p = np.where(nucleus, p, 0.0)
    p /= p.sum()
  return p


@pytest.mark.parametrize('sampler', [SamplerConfig(temperature=1.0),
                                     SamplerConfig(temperature=0.7, top_k=6),
                                     SamplerConfig(temperature=1.3, top_p=0.8),
                                     SamplerConfig(temperature=1.0, top_k=10, top_p=0.9)])
def test_token_frequencies_match_the_filtered_softmax(sampler):
  logits = np.asarray(jax.random.normal(jax.random.key(3), (32,)) * 1.5)
  keys = sampling.token_keys(jax.random.key(11), jnp.arange(DRAWS), jnp.full((DRAWS,), 5))
  tokens = np.asarray(jax.jit(sampling.draw, static_argnums=2)(
      jnp.broadcast_to(jnp.asarray(logits), (DRAWS, 32)), keys, sampler))
  expected = _expected_probs(logits, sampler)
  counts = np.bincount(tokens, minlength=32)
  assert counts[expected == 0].sum() == 0, 'drew a token the filter removed'
  support = expected > 0
  stat = np.sum((counts[support] - DRAWS * expected[support]) ** 2 / (DRAWS * expected[support]))
  dof = support.sum() - 1
  p_value = float(gammaincc(dof / 2, stat / 2))
  assert p_value > 1e-3, (stat, dof, p_value)


def test_greedy_is_argmax_and_keys_follow_the_contract():
  logits = jax.random.normal(jax.random.key(0), (4, 50))
  keys = sampling.token_keys(jax.random.key(1), jnp.arange(4), jnp.arange(4))
  np.testing.assert_array_equal(sampling.draw(logits, keys, SamplerConfig(temperature=0.0)),
                                np.argmax(logits, -1))
  manual = jax.random.fold_in(jax.random.fold_in(jax.random.key(1), 2), 2)
  assert jnp.array_equal(jax.random.key_data(keys[2]), jax.random.key_data(manual))


def test_a_sampled_draw_follows_the_two_level_contract():
  sampler = SamplerConfig(temperature=0.8, top_k=20)
  vocab = 50
  logits = jax.random.normal(jax.random.key(0), (4, vocab)) * 2
  keys = sampling.token_keys(jax.random.key(1), jnp.arange(4), jnp.arange(4) + 7)
  b = sampling.block_size(vocab)
  assert b == 8  # sqrt(50) = 7.1
  manual = []
  for row in range(4):
    w = np.full(7 * b, -np.inf, np.float32)
    w[:vocab] = np.asarray(sampling.transform_logits(logits[row], sampler))
    w = w.reshape(7, b)
    masses = np.log(np.exp(w - w.max()).sum(axis=1)) + w.max()
    j = int(np.argmax(masses + np.asarray(
        jax.random.gumbel(jax.random.fold_in(keys[row], 0), (7,)))))
    noise = jax.random.gumbel(jax.random.fold_in(jax.random.fold_in(keys[row], 1), j), (b,))
    manual.append(j * b + int(np.argmax(w[j] + np.asarray(noise))))
  np.testing.assert_array_equal(sampling.draw(logits, keys, sampler), manual)


def test_logit_differences_of_float_noise_rarely_move_a_draw():
  # A 49k-vocabulary policy's long tail put inverse-CDF boundaries 1e-7 apart, so logits that
  # differed by ~1e-5 between a tree forward and a one-token forward moved 1 token in ~2000
  # (notes/history.md, "Sampling near-ties"). Gumbel-max only flips when the best two perturbed
  # scores (of blocks, then of tokens) are within the noise, whose gap is of order one.
  vocab, draws = 8192, 4000
  # Zipf-like, with the tail spread over the ids as in a real vocabulary.
  ranks = jax.random.permutation(jax.random.key(3), jnp.arange(1, vocab + 1, dtype=jnp.float32))
  logits = -1.2 * jnp.log(ranks) + jax.random.normal(jax.random.key(0), (draws, vocab))
  shifted = logits + 1e-5 * jax.random.normal(jax.random.key(1), (draws, vocab))
  keys = sampling.token_keys(jax.random.key(2), jnp.arange(draws), jnp.full((draws,), 3))
  draw = jax.jit(sampling.draw, static_argnums=2)
  sampler = SamplerConfig(temperature=1.0)
  moved = int(jnp.sum(draw(logits, keys, sampler) != draw(shifted, keys, sampler)))
  assert moved <= 1, f'{moved} of {draws} draws moved under 1e-5 logit noise'


@pytest.mark.parametrize('kwargs', [dict(temperature=-1.0), dict(top_k=-2), dict(top_p=0.0),
                                    dict(top_p=1.5)])
def test_bad_sampler_settings_are_rejected(kwargs):
  with pytest.raises(ValueError, match=next(iter(kwargs))):
    SamplerConfig(**kwargs)
