"""Windowed cache attention against the plain attention over the whole cache."""
import jax
import jax.numpy as jnp
import numpy as np

from specroll_jax.model.attention import (MIN_WINDOWED_SLOTS, block_attention, cache_windows,
                                          full_cache_attention)


def test_windows_cover_the_cache_in_quarters():
  assert cache_windows(MIN_WINDOWED_SLOTS - 1) == (MIN_WINDOWED_SLOTS - 1,)
  assert cache_windows(256) == (64, 128, 192, 256)
  assert cache_windows(400) == (112, 224, 336, 400)


def test_windowed_attention_equals_attention_over_the_whole_cache():
  batch, slots, t_len, heads, kv_heads, head_dim = 3, 256, 3, 4, 2, 16
  rng = np.random.default_rng(0)
  normal = lambda *dims: jnp.asarray(rng.standard_normal(dims, np.float32))
  q = normal(batch, t_len, heads, head_dim)
  k_cache = normal(batch, kv_heads, head_dim, slots)
  v_cache = normal(batch, kv_heads, slots, head_dim)
  k_block, v_block = (normal(batch, t_len, kv_heads, head_dim) for _ in range(2))
  # A chain and a fork: node 2 sees node 0 but not node 1.
  block_mask = jnp.asarray(np.broadcast_to(
      np.array([[1, 0, 0], [1, 1, 0], [1, 0, 1]], bool), (batch, t_len, t_len)))
  windowed = jax.jit(lambda lengths: block_attention(
      q, k_cache, v_cache, lengths, k_block, v_block, block_mask, scale=0.25))
  # The longest row picks the window: on either side of every window boundary, and empty.
  for longest in (0, 1, 63, 64, 65, 128, 191, 193, 255, 256):
    lengths = jnp.asarray([longest, longest // 2, 0], jnp.int32)
    expected = full_cache_attention(q, k_cache, v_cache, lengths, k_block, v_block,
                                    block_mask, scale=0.25)
    np.testing.assert_allclose(windowed(lengths), expected, rtol=1e-6, atol=1e-6)
