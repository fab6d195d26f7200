"""Pallas kernel for block (tree) attention over a ragged KV cache.

Drop-in replacement for `specroll_jax.attention.block_attention`: same arguments, same
result. One program handles one (batch row, kv head, query-row tile); the query rows of a
program are the T block tokens times the H // KVH query heads sharing that kv head, so a
cache tile is read once per kv group, not once per query head. The cache is streamed in
tiles of `block_s` keys with an online softmax in float32, the loop stops after the last
tile holding a valid slot, and the T block keys are folded in last under `block_mask`.

Each platform gets its own lowering, chosen when the call is lowered (through
`lax.platform_dependent`), not from the machine it is traced on, so the kernel can be
exported for a GPU or a TPU from a CPU host (tests/kernels/test_kernel_export.py does):
  * cuda: Triton. JAX's default GPU path, Mosaic GPU, copies whole tiles with TMA and
    rejects copies that are not a multiple of the 128-thread warpgroup (16 bytes of
    cache lengths already fail), and its `pallas_call` entry point is deprecated for
    `plgpu.kernel`; Triton takes ordinary BlockSpec grids and runs on Ampere as well
    as Hopper. Triton only handles power-of-two tensors and needs matmul dims >= 16, so
    query rows and block keys are padded to a power of two >= 16 (padding is masked out)
    and `block_s` and the head dim must be powers of two.
  * tpu: Mosaic. It wants the last two block dims either whole or (8, 128)-aligned. The
    head-major cache (keys [B, KVH, Dh, S], values [B, KVH, S, Dh]) gives each program a
    whole [Dh, S] key slab and [S, Dh] value slab; the small
    per-block tensors are transposed head-major here to match. Scalar prefetch is
    TPU-only, so cache_lengths is an ordinary int32 input read whole, placed in SMEM
    because scalars cannot be read out of VMEM.
  * cpu: the Pallas interpreter (there is no compiled CPU lowering).
"""
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

# Finite stand-in for -inf: with no infinities, exp(m_old - m_new) never sees inf - inf,
# so rows that have not met a visible key yet carry zeros instead of NaNs.
_MASKED = -1e30
# Most query rows one program holds; more would spill the float32 accumulator and score
# tile out of GPU registers. Power of two so Triton accepts it.
_MAX_ROWS = 128
# Triton matmuls need every dimension >= 16.
_MIN_DOT_DIM = 16


def _kernel(lengths_ref, q_ref, k_cache_ref, v_cache_ref, k_block_ref, v_block_ref,
            mask_ref, out_ref, *, scale, block_s):
  cache_len = lengths_ref[pl.program_id(0)]
  q = q_ref[...]

  def attend(carry, k, v, visible, key_dim):
    """One tile of keys: `k` is [Dh, keys] in the cache (key_dim 0), [keys, Dh] in the
    block (key_dim 1)."""
    acc, row_max, row_sum = carry
    scores = lax.dot_general(q, k, (((1,), (key_dim,)), ((), ())),
                             preferred_element_type=jnp.float32) * scale
    scores = jnp.where(visible, scores, _MASKED)
    new_max = jnp.maximum(row_max, scores.max(axis=1, keepdims=True))
    # The select matters for rows whose every key so far is masked: there new_max is
    # _MASKED itself and exp(scores - new_max) would count masked keys with weight 1.
    probs = jnp.where(visible, jnp.exp(scores - new_max), 0.0)
    rescale = jnp.exp(row_max - new_max)
    # Probabilities go to the values' dtype so bf16 caches use bf16 matmuls; the
    # accumulation stays float32.
    acc = rescale * acc + lax.dot_general(probs.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                          preferred_element_type=jnp.float32)
    return acc, new_max, rescale * row_sum + probs.sum(axis=1, keepdims=True)

  def cache_tile(i, carry):
    start = pl.multiple_of(i * block_s, block_s)
    tile = pl.ds(start, block_s)
    visible = start + jnp.arange(block_s)[None, :] < cache_len
    return attend(carry, k_cache_ref[:, tile], v_cache_ref[tile, :], visible, key_dim=0)

  rows, head_dim = q.shape
  carry = (jnp.zeros((rows, head_dim), jnp.float32),
           jnp.full((rows, 1), _MASKED, jnp.float32),
           jnp.zeros((rows, 1), jnp.float32))
  # Tiles past the row's cache length are never loaded: ragged rows cost what they hold.
  carry = lax.fori_loop(0, pl.cdiv(cache_len, block_s), cache_tile, carry)
  acc, _, row_sum = attend(carry, k_block_ref[...], v_block_ref[...], mask_ref[...] != 0,
                          key_dim=1)
  out_ref[...] = jnp.where(row_sum > 0, acc / row_sum, 0.0).astype(out_ref.dtype)


def _pad_axis(x, axis, size):
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, pad)


def _dot_dim(n):
  return max(_MIN_DOT_DIM, pl.next_power_of_2(n))


@functools.partial(jax.jit, static_argnames=('scale', 'block_s', 'interpret'))
def tree_attention(q, k_cache, v_cache, cache_lengths, k_block, v_block, block_mask, *,
                   scale, block_s=128, interpret=False):
  """Pallas version of `block_attention`; see there for arguments and result.

  Args beyond `block_attention`'s:
    block_s: cache keys per tile (a power of two for GPU, a multiple of 8 for TPU). A
      cache whose S is not a multiple of it is padded here, which copies it; allocate S
      as a multiple of block_s to avoid that.
    interpret: run the kernel in the Pallas interpreter on every platform (CPU always
      does), e.g. to debug it on a GPU host.
  """
  batch, t_len, num_heads, head_dim = q.shape
  s_len = v_cache.shape[2]
  num_kv = k_block.shape[2]
  groups = num_heads // num_kv

  # Row r of a kv group is block token r // groups, query head r % groups.
  rows = t_len * groups
  rows_padded = _dot_dim(rows)
  q_rows = q.reshape(batch, t_len, num_kv, groups, head_dim).transpose(0, 2, 1, 3, 4)
  q_rows = _pad_axis(q_rows.reshape(batch, num_kv, rows, head_dim), 2, rows_padded)
  keys_padded = _dot_dim(t_len)
  mask_rows = jnp.repeat(block_mask, groups, axis=1).astype(jnp.int32)
  mask_rows = _pad_axis(_pad_axis(mask_rows, 1, rows_padded), 2, keys_padded)
  k_block = _pad_axis(k_block, 1, keys_padded).transpose(0, 2, 1, 3)
  v_block = _pad_axis(v_block, 1, keys_padded).transpose(0, 2, 1, 3)

  # At least one tile even for S == 0, so no block is empty; padding slots are never
  # visible because lengths are clipped to the real S, as the reference's mask implies.
  s_padded = max(1, pl.cdiv(s_len, block_s)) * block_s
  k_cache = _pad_axis(k_cache, 3, s_padded)
  v_cache = _pad_axis(v_cache, 2, s_padded)
  lengths = jnp.clip(cache_lengths, 0, s_len).astype(jnp.int32)

  operands = (lengths, q_rows, k_cache, v_cache, k_block, v_block, mask_rows)
  call = lambda platform: functools.partial(_tree_attention_call, platform, scale=scale,
                                            block_s=block_s)
  if interpret:
    out = call('interpret')(*operands)
  else:
    out = lax.platform_dependent(*operands, cpu=call('interpret'), cuda=call('cuda'),
                                 tpu=call('tpu'))
  out = out[:, :, :rows].reshape(batch, num_kv, t_len, groups, head_dim)
  return out.transpose(0, 2, 1, 3, 4).reshape(batch, t_len, num_heads, head_dim)


def _tree_attention_call(platform, lengths, q_rows, k_cache, v_cache, k_block, v_block,
                         mask_rows, *, scale, block_s):
  """The kernel over prepared operands, lowered for `platform` ('cuda', 'tpu' or
  'interpret')."""
  batch, num_kv, rows_padded, head_dim = q_rows.shape
  s_padded, keys_padded = v_cache.shape[2], k_block.shape[2]
  block_rows = min(rows_padded, _MAX_ROWS)
  key_cache_spec = pl.BlockSpec((None, None, head_dim, s_padded), lambda b, h, r: (b, h, 0, 0))
  value_cache_spec = pl.BlockSpec((None, None, s_padded, head_dim), lambda b, h, r: (b, h, 0, 0))
  block_kv_spec = pl.BlockSpec((None, None, keys_padded, head_dim),
                               lambda b, h, r: (b, h, 0, 0))
  rows_spec = pl.BlockSpec((None, None, block_rows, head_dim), lambda b, h, r: (b, h, r, 0))
  compiler_params = {'cuda': pltriton.CompilerParams(),
                     'tpu': pltpu.CompilerParams()}.get(platform)
  return pl.pallas_call(
      functools.partial(_kernel, scale=scale, block_s=block_s),
      grid=(batch, num_kv, rows_padded // block_rows),
      in_specs=[
          pl.BlockSpec(memory_space=pltpu.SMEM if platform == 'tpu' else None),
          rows_spec,
          key_cache_spec,
          value_cache_spec,
          block_kv_spec,
          block_kv_spec,
          pl.BlockSpec((None, block_rows, keys_padded), lambda b, h, r: (b, r, 0)),
      ],
      out_specs=rows_spec,
      out_shape=jax.ShapeDtypeStruct(q_rows.shape, q_rows.dtype),
      interpret=platform == 'interpret',
      compiler_params=compiler_params,
      name='tree_attention',
  )(lengths, q_rows, k_cache, v_cache, k_block, v_block, mask_rows)
