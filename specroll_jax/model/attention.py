"""Block attention over a KV cache: the one attention rule every forward uses.

Queries are a block of T tokens per row. Keys are the row's cached prefix (slots
`< cache_lengths[b]`) followed by the block itself, filtered by an explicit
`block_mask[b, i, j]` (query i may see block token j). Prefill, decode, full-sequence
training forwards and tree verification differ only in the mask they pass.

The cache is stored head-major, keys [B, KVH, Dh, S] and values [B, KVH, S, Dh], so that
the per-step score and value products are plain matmuls over it without a transpose: on
CPU the transposes cost as much as the products.
"""
import functools

import jax
import jax.numpy as jnp

from specroll_jax.model.invariant_attention import invariant_cache_attention

# A finite stand-in for -inf so a fully masked query row yields zeros, not NaNs.
_MASKED = -1e30


# Cache windows are multiples of this many slots (and at most _MAX_WINDOWS of them).
_WINDOW_QUANTUM = 16
_MAX_WINDOWS = 4
# Smaller caches are read whole: their attention is cheap, and every window is another
# attention body per layer to compile.
MIN_WINDOWED_SLOTS = 256


def cache_windows(cache_slots: int) -> tuple[int, ...]:
  """The static prefixes of a cache that attention may read: S/4, S/2, 3S/4, S (rounded)."""
  if cache_slots < MIN_WINDOWED_SLOTS:
    return (cache_slots,)
  step = -(-cache_slots // _MAX_WINDOWS // _WINDOW_QUANTUM) * _WINDOW_QUANTUM
  return tuple(range(step, cache_slots, step)) + (cache_slots,)


def block_attention(q, k_cache, v_cache, cache_lengths, k_block, v_block, block_mask, *, scale,
                    body=None):
  """Grouped-query attention of a query block over cache prefix + block.

  Reads only the smallest cache window holding every row's valid slots (a `lax.switch`
  over `cache_windows`, so the compiled shapes stay fixed): early decode steps do not pay
  for slots that no row has filled yet. Slots past a row's length are masked either way.

  Args:
    q: [B, T, H, Dh] queries (RoPE already applied).
    k_cache: [B, KVH, Dh, S] cached keys; S may be 0.
    v_cache: [B, KVH, S, Dh] cached values.
    cache_lengths: int32 [B], number of valid cache slots per row.
    k_block, v_block: [B, T, KVH, Dh] keys/values of the block tokens.
    block_mask: bool [B, T, T], query i sees block key j.
    scale: softmax scale (usually Dh ** -0.5).
    body: the attention over one window (`full_cache_attention` when None).

  Returns:
    [B, T, H, Dh] attention output in q's dtype.
  """
  windows = cache_windows(v_cache.shape[2])
  body = body or full_cache_attention
  attend = lambda window: lambda *args: body(
      q, args[0][..., :window], args[1][:, :, :window], *args[2:], scale=scale)
  operands = (k_cache, v_cache, cache_lengths, k_block, v_block, block_mask)
  if len(windows) == 1:
    return attend(windows[0])(*operands)
  needed = jnp.searchsorted(jnp.asarray(windows), jnp.max(cache_lengths))
  return jax.lax.switch(needed, [attend(w) for w in windows], *operands)


def full_cache_attention(q, k_cache, v_cache, cache_lengths, k_block, v_block, block_mask, *,
                         scale):
  """`block_attention` reading every slot of the cache it is given: the body of each window,
  and the plain reference the windowed attention is tested against."""
  batch, t_len, num_heads, head_dim = q.shape
  num_kv = k_block.shape[2]
  groups = num_heads // num_kv
  s_len = v_cache.shape[2]
  # Queries of one kv head are grouped as rows (t, g) of a [T*G, Dh] matrix.
  qg = q.reshape(batch, t_len, num_kv, groups, head_dim).transpose(0, 2, 1, 3, 4)
  qg = qg.reshape(batch, num_kv, t_len * groups, head_dim).astype(jnp.float32) * scale
  f32 = lambda x: x.astype(jnp.float32)
  cache_scores = jnp.einsum('bkqd,bkds->bkqs', qg, f32(k_cache))
  block_scores = jnp.einsum('bkqd,btkd->bkqt', qg, f32(k_block))
  prefix_mask = (jnp.arange(s_len)[None, :] < cache_lengths[:, None])[:, None, None, :]
  rows_mask = jnp.repeat(block_mask, groups, axis=1)[:, None]  # [B, 1, T*G, T]
  scores = jnp.concatenate([jnp.where(prefix_mask, cache_scores, _MASKED),
                            jnp.where(rows_mask, block_scores, _MASKED)], axis=-1)
  mask = jnp.concatenate([jnp.broadcast_to(prefix_mask, cache_scores.shape),
                          jnp.broadcast_to(rows_mask, block_scores.shape)], axis=-1)
  weights = jnp.where(mask, jax.nn.softmax(scores, axis=-1), 0.0)
  out = (jnp.einsum('bkqs,bksd->bkqd', weights[..., :s_len], f32(v_cache))
         + jnp.einsum('bkqt,btkd->bkqd', weights[..., s_len:], f32(v_block)))
  out = out.reshape(batch, num_kv, t_len, groups, head_dim).transpose(0, 2, 1, 3, 4)
  return out.reshape(batch, t_len, num_heads, head_dim).astype(q.dtype)


# The bf16 compute mode's attention: the same windows, each read batch-invariantly.
invariant_block_attention = functools.partial(block_attention, body=invariant_cache_attention)

ATTENTION_IMPLEMENTATIONS = ('xla', 'pallas')


def attention_implementation(name: str):
  """'xla' (block_attention) or 'pallas' (kernels.tree_attention, same contract).

  XLA is the default everywhere: on CPU the Pallas kernel only runs in interpret mode
  (30-100x slower, see kernels/bench_tree_attention.py), and it has not yet been timed or
  verified on a GPU or TPU in this project.
  """
  if name == 'xla':
    return block_attention
  if name == 'pallas':
    from kernels.tree_attention import tree_attention  # Pallas import only when chosen
    return tree_attention
  raise ValueError(f'unknown attention implementation {name!r} '
                   f'(choose from {", ".join(ATTENTION_IMPLEMENTATIONS)})')
