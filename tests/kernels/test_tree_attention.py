"""The Pallas tree-attention kernel against the XLA reference `block_attention`.

Every distinct shape costs a kernel compilation (about a second in interpret mode), so
all tests draw from the few shapes in SHAPES and vary only the data.
"""
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.tree_attention import tree_attention
from specroll_jax.model.attention import block_attention

# (batch, cache slots S, block tokens T, heads H, kv heads KVH, head dim, block_s).
# Head dims and block_s stay >= 16 so the same tests also compile for Triton on a GPU.
SHAPES = [
    (2, 32, 4, 2, 2, 16, 16),   # GQA ratio 1, S a multiple of block_s: two cache tiles
    (3, 40, 5, 4, 2, 32, 16),   # ratio 2, S padded from 40 to 48 inside the wrapper
    (2, 32, 3, 8, 2, 16, 16),   # ratio 4
    (2, 24, 40, 4, 1, 16, 16),  # ratio 4, 160 query rows: two query-row tiles per program
]
F32_TOL = 1e-5


def ancestor_mask(parents):
  """Ancestor-or-self mask of a forest given parent[i] < i (-1 for a root)."""
  t_len = len(parents)
  mask = np.eye(t_len, dtype=bool)
  for i, parent in enumerate(parents):
    if parent >= 0:
      mask[i] |= mask[parent]
  return mask


def make_inputs(shape, seed, cache_lengths, dtype=jnp.float32):
  batch, s_len, t_len, heads, kv_heads, head_dim, _ = shape
  rng = np.random.default_rng(seed)
  normal = lambda *dims: jnp.asarray(rng.standard_normal(dims, np.float32), dtype)
  parents = [[rng.integers(-1, i) for i in range(t_len)] for _ in range(batch)]
  return dict(
      q=normal(batch, t_len, heads, head_dim),
      k_cache=normal(batch, kv_heads, head_dim, s_len),
      v_cache=normal(batch, kv_heads, s_len, head_dim),
      cache_lengths=jnp.asarray(cache_lengths, jnp.int32),
      k_block=normal(batch, t_len, kv_heads, head_dim),
      v_block=normal(batch, t_len, kv_heads, head_dim),
      block_mask=jnp.asarray(np.stack([ancestor_mask(p) for p in parents])),
  )


def run_both(shape, inputs):
  scale = shape[5] ** -0.5
  # Pins the reference to full float32 matmuls on GPUs that would otherwise use TF32.
  with jax.default_matmul_precision('highest'):
    expected = block_attention(**inputs, scale=scale)
  return tree_attention(**inputs, scale=scale, block_s=shape[6]), expected


def assert_close(actual, expected, atol=F32_TOL, rtol=0.0):
  np.testing.assert_allclose(np.asarray(actual, np.float32), np.asarray(expected, np.float32),
                             rtol=rtol, atol=atol)


@pytest.mark.parametrize('shape', SHAPES)
def test_matches_reference_at_length_extremes(shape):
  batch, s_len = shape[:2]
  lengths = [(0, s_len, s_len // 2 + 1)[b % 3] for b in range(batch)]
  actual, expected = run_both(shape, make_inputs(shape, seed=0, cache_lengths=lengths))
  assert_close(actual, expected)


@st.composite
def cases(draw):
  shape = draw(st.sampled_from(SHAPES))
  batch, s_len = shape[:2]
  lengths = draw(st.lists(st.integers(0, s_len), min_size=batch, max_size=batch))
  return shape, draw(st.integers(0, 2**31 - 1)), lengths


@hypothesis.settings(max_examples=25, deadline=None, derandomize=True)
@hypothesis.given(cases())
def test_matches_reference_on_random_trees(case):
  shape, seed, lengths = case
  actual, expected = run_both(shape, make_inputs(shape, seed, lengths))
  assert_close(actual, expected)


def test_empty_cache():
  shape = (2, 0, 4, 4, 2, 16, 16)
  actual, expected = run_both(shape, make_inputs(shape, seed=1, cache_lengths=[0, 0]))
  assert_close(actual, expected)


def test_bfloat16_matches_reference_on_same_inputs():
  shape = SHAPES[1]
  inputs = make_inputs(shape, seed=2, cache_lengths=[40, 7, 0], dtype=jnp.bfloat16)
  actual, expected = run_both(shape, inputs)
  # Both sides compute nearly the same float32 value and round it to bf16, whose spacing
  # is up to 2**-7 of the magnitude: the two roundings may land one spacing apart
  # (0.0156 at |out| ~ 2-4, which this data reaches), hence rtol = 2 spacings = 2**-6.
  # The kernel also rounds the probabilities to bf16 (relative error <= 2**-8) before the
  # value matmul, moving the float32 value by at most 2**-8 * max|v| < 2**-6 for these
  # N(0, 1) values, hence atol. A real bug (wrong mask, lost rescale) is off by O(0.1).
  assert actual.dtype == jnp.bfloat16
  assert_close(actual, expected, atol=2**-6, rtol=2**-6)


def test_fully_masked_row_gives_zeros():
  shape = SHAPES[0]
  inputs = make_inputs(shape, seed=3, cache_lengths=[0, 5])
  # Row 0 has an empty cache; hiding every block key from its query 1 leaves that
  # query nothing to attend to.
  inputs['block_mask'] = inputs['block_mask'].at[0, 1].set(False)
  actual, expected = run_both(shape, inputs)
  assert np.all(np.asarray(actual[0, 1]) == 0.0)
  assert np.isfinite(np.asarray(actual)).all()
  assert_close(actual, expected)


def test_out_of_range_lengths_read_as_the_reference_does():
  shape = SHAPES[1]
  # The reference's `slot < length` mask treats a length past S as S and a negative one
  # as 0; the kernel must not read its padding slots (or beyond) for them.
  actual, expected = run_both(shape, make_inputs(shape, seed=4, cache_lengths=[45, -1, 100]))
  assert_close(actual, expected)
