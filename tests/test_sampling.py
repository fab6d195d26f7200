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


@pytest.mark.parametrize('kwargs', [dict(temperature=-1.0), dict(top_k=-2), dict(top_p=0.0),
                                    dict(top_p=1.5)])
def test_bad_sampler_settings_are_rejected(kwargs):
  with pytest.raises(ValueError, match=next(iter(kwargs))):
    SamplerConfig(**kwargs)
