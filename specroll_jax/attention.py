"""Block attention over a KV cache: the one attention rule every forward uses.

Queries are a block of T tokens per row. Keys are the row's cached prefix (slots
`< cache_lengths[b]`) followed by the block itself, filtered by an explicit
`block_mask[b, i, j]` (query i may see block token j). Prefill, decode, full-sequence
training forwards and tree verification differ only in the mask they pass.
"""
import jax
import jax.numpy as jnp

# A finite stand-in for -inf so a fully masked query row yields zeros, not NaNs.
_MASKED = -1e30


def block_attention(q, k_cache, v_cache, cache_lengths, k_block, v_block, block_mask, *, scale):
  """Grouped-query attention of a query block over cache prefix + block.

  Args:
    q: [B, T, H, Dh] queries (RoPE already applied).
    k_cache, v_cache: [B, S, KVH, Dh] cached keys/values; S may be 0.
    cache_lengths: int32 [B], number of valid cache slots per row.
    k_block, v_block: [B, T, KVH, Dh] keys/values of the block tokens.
    block_mask: bool [B, T, T], query i sees block key j.
    scale: softmax scale (usually Dh ** -0.5).

  Returns:
    [B, T, H, Dh] attention output in q's dtype.
  """
  batch, t_len, num_heads, head_dim = q.shape
  num_kv = k_block.shape[2]
  groups = num_heads // num_kv
  qg = q.reshape(batch, t_len, num_kv, groups, head_dim).astype(jnp.float32) * scale
  s_len = k_cache.shape[1]
  prefix_mask = jnp.arange(s_len)[None, :] < cache_lengths[:, None]  # [B, S]
  keys = jnp.concatenate([k_cache, k_block], axis=1).astype(jnp.float32)
  values = jnp.concatenate([v_cache, v_block], axis=1).astype(jnp.float32)
  mask = jnp.concatenate(
      [jnp.broadcast_to(prefix_mask[:, None, :], (batch, t_len, s_len)), block_mask], axis=2)
  scores = jnp.einsum('btkgd,bskd->bkgts', qg, keys)
  scores = jnp.where(mask[:, None, None, :, :], scores, _MASKED)
  weights = jax.nn.softmax(scores, axis=-1)
  weights = jnp.where(mask[:, None, None, :, :], weights, 0.0)
  out = jnp.einsum('bkgts,bskd->btkgd', weights, values)
  return out.reshape(batch, t_len, num_heads, head_dim).astype(q.dtype)
