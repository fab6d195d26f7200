"""Batch-invariant block attention for the bfloat16 compute mode; `block_attention`'s contract.

A query at absolute position p must get the same bits whether its keys sit in the cache
(a plain step), partly in the block (a tree node sees its ancestors there), or all in the
block (prefill, the learner's full sequence), and whatever the cache window. So every query
sums over keys laid out by absolute position, cut into chunks of `CHUNK` positions:

  scores   q . k: exact bf16 products and a pairwise sum over head_dim (`pairwise_dot`);
  peak     the max over the visible scores (exact in any order);
  weights  exp(score - peak), 0 where hidden or below the floor, rounded to bf16;
  chunk j  its numerator sum_p w_p v_p (`pairwise_dot` over the CHUNK positions) and its
           denominator (a pairwise sum of the same rounded weights);
  total    a pairwise sum over the chunk index, then numerator / denominator.

Chunks past a query's position are all zeros, so windows of different lengths give the same
pairwise sums. Cache slot s holds position s. The block's key j sits at position L + d_j,
where L is the row's cache length and d_j = (block keys j sees) - 1 is its depth: true of a
one-token step, a chain and a tree (a node sees its ancestors and itself), and of prefill and
the full sequence (empty cache, causal mask). Chunks wholly below the row's first block
position are read from the cache once per row; the few chunks that hold block positions are
assembled per query, from the cache below L and from the query's own ancestors above it.
"""
import jax
import jax.numpy as jnp

from specroll_jax.model import invariant

CHUNK = 32  # positions per chunk; cache windows of other lengths are padded to whole chunks


def _scores(qg, keys):
  """qg [B, KVH, Q, Dh] . keys [B, KVH, Dh, S] -> float32 [B, KVH, Q, S], as exact bf16
  products and a pairwise sum over Dh. As a dot, with either operand as rows, XLA picked
  kernels whose bits changed with the program around them (SmolLM2 with q as rows,
  stories260K with the keys as rows: a full-sequence forward against prefill + decode)."""
  to_bf16 = lambda a: a.astype(invariant.BF16).astype(jnp.float32)
  # Over Dh as the leading axis: the tree adds whole [Q, S] planes.
  return invariant.pairwise_dot(jnp.swapaxes(to_bf16(qg), 2, 3)[:, :, :, :, None],
                                to_bf16(keys)[:, :, :, None], axis=2)


def _chunk_sums(values, weights):
  """values [..., C, Dh] and weights [..., Q, C] -> numerators [..., Dh, Q], denominators
  [..., Q]: one chunk's share of each query's attention."""
  to_bf16 = lambda a: a.astype(invariant.BF16).astype(jnp.float32)
  # Exact bf16 products and a pairwise sum over C, in whole [Q, Dh] planes: as a dot, the
  # kernel XLA picked, and so the bits, changed with the program around it.
  numerators = jnp.swapaxes(invariant.pairwise_dot(
      to_bf16(values)[..., :, None, :], jnp.swapaxes(to_bf16(weights), -1, -2)[..., None],
      axis=-3), -1, -2)
  return numerators, invariant.pairwise_sum(weights)


def _pad_to_chunks(x, axis):
  return invariant.pad_axis(x, axis, invariant.ceil_div(x.shape[axis], CHUNK) * CHUNK)


def _chunked(x, axis):
  """Splits `axis` (a multiple of CHUNK) into [chunks, CHUNK] in place."""
  shape = x.shape[:axis] + (x.shape[axis] // CHUNK, CHUNK) + x.shape[axis + 1:]
  return x.reshape(shape)


def _peak(*masked_scores):
  peak = jnp.max(jnp.stack([jnp.max(s, axis=-1) for s in masked_scores]), axis=0)
  return jnp.where(jnp.isfinite(peak), peak, 0.0)[..., None]


def _finish(numerators, denominators):
  """Pairwise sums over the chunk axis (2) -> [B, KVH, Dh, Q] attention outputs."""
  numerator = invariant.pairwise_sum(numerators, axis=2)
  denominator = invariant.pairwise_sum(denominators, axis=2)
  safe = jnp.where(denominator > 0, denominator, 1.0)
  return numerator / safe[:, :, None, :]


def block_only_attention(qg, k_block, v_block, visible):
  """An empty cache: block key j at position j (prefill, the learner's full sequence).

  qg [B, KVH, Q, Dh]; k_block [B, KVH, Dh, T]; v_block [B, KVH, T, Dh]; visible [B, 1, Q, T].
  """
  scores = _scores(qg, k_block)
  weights = invariant.attention_weights(
      scores, _peak(jnp.where(visible, scores, -jnp.inf)), visible)
  values = _chunked(_pad_to_chunks(v_block, 2), 2)                    # [B, KVH, J, C, Dh]
  weights = jnp.swapaxes(_chunked(_pad_to_chunks(weights, 3), 3), 2, 3)  # [B, KVH, J, Q, C]
  return _finish(*_chunk_sums(values, weights))


def cached_attention(qg, k_cache, v_cache, cache_lengths, k_block, v_block, block_mask):
  """A non-empty cache window [0, S) and a block of T tokens at positions L + depth.

  qg [B, KVH, T*G, Dh]; k_cache [B, KVH, Dh, S]; v_cache [B, KVH, S, Dh];
  k_block [B, KVH, Dh, T]; v_block [B, KVH, T, Dh]; block_mask [B, T, T].
  """
  batch, num_kv, queries, head_dim = qg.shape
  t_len = block_mask.shape[1]
  groups = queries // t_len
  s_len = v_cache.shape[2]
  lengths = cache_lengths[:, None]
  cache_visible = (jnp.arange(s_len)[None, :] < lengths)[:, None, None, :]
  block_visible = jnp.repeat(block_mask, groups, axis=1)[:, None]
  cache_scores = _scores(qg, k_cache)
  block_scores = _scores(qg, k_block)
  peak = _peak(jnp.where(cache_visible, cache_scores, -jnp.inf),
               jnp.where(block_visible, block_scores, -jnp.inf))
  cache_weights = invariant.attention_weights(cache_scores, peak, cache_visible)
  block_weights = invariant.attention_weights(block_scores, peak, block_visible)

  # Chunks below the chunk holding L come from the cache, shared by the row's queries.
  first = (cache_lengths // CHUNK) * CHUNK                             # [B]
  below = jnp.arange(s_len)[None, None, None, :] < first[:, None, None, None]
  shared_weights = jnp.swapaxes(
      _chunked(_pad_to_chunks(jnp.where(below, cache_weights, 0.0), 3), 3), 2, 3)
  shared_values = _chunked(_pad_to_chunks(v_cache, 2), 2)
  numerators, denominators = _chunk_sums(shared_values, shared_weights)

  # The chunks from `first` on, per query: cache below L, the query's ancestors above it.
  boundary = 1 + invariant.ceil_div(t_len - 1, CHUNK)
  positions = first[:, None] + jnp.arange(boundary * CHUNK)[None, :]    # [B, R]
  in_cache = positions < lengths
  depth = jnp.sum(block_mask, axis=-1) - 1                             # [B, T]
  offsets = positions - lengths                                        # [B, R]
  is_ancestor = block_mask[:, :, None, :] & (depth[:, None, None, :] == offsets[:, None, :, None])
  has_ancestor = jnp.any(is_ancestor, axis=-1)                         # [B, T, R]
  ancestor = jnp.argmax(is_ancestor, axis=-1)                          # [B, T, R]
  slots = jnp.clip(positions, 0, s_len - 1)
  from_cache = jnp.take_along_axis(cache_weights, slots[:, None, None, :], axis=-1)
  from_cache = from_cache.reshape(batch, num_kv, t_len, groups, -1)
  per_query = block_weights.reshape(batch, num_kv, t_len, groups, t_len)
  from_block = jnp.take_along_axis(per_query, ancestor[:, None, :, None, :], axis=-1)
  weights = jnp.where(in_cache[:, None, None, None, :], from_cache,
                      jnp.where(has_ancestor[:, None, :, None, :], from_block, 0.0))
  cache_values = jnp.take_along_axis(v_cache, slots[:, None, :, None], axis=2)
  block_values = jnp.take_along_axis(v_block[:, :, None], ancestor[:, None, :, :, None], axis=3)
  values = jnp.where(in_cache[:, None, None, :, None], cache_values[:, :, None].astype(jnp.float32),
                     jnp.where(has_ancestor[:, None, :, :, None], block_values.astype(jnp.float32),
                               0.0))
  values = _chunked(values, 3)                                          # [B, KVH, T, R/C, C, Dh]
  weights = jnp.swapaxes(_chunked(weights, 4), 3, 4)                   # [B, KVH, T, R/C, G, C]
  edge_numerators, edge_denominators = _chunk_sums(values, weights)
  # [B, KVH, T, R/C, Dh, G] -> [B, KVH, R/C, Dh, T*G]; queries are rows (t, g).
  edge_numerators = edge_numerators.transpose(0, 1, 3, 4, 2, 5).reshape(
      batch, num_kv, boundary, head_dim, queries)
  edge_denominators = edge_denominators.transpose(0, 1, 3, 2, 4).reshape(
      batch, num_kv, boundary, queries)

  # Place the boundary chunks at chunk index first / CHUNK; those slots hold zeros.
  chunks = numerators.shape[2] + boundary
  numerators = invariant.pad_axis(numerators, 2, chunks)
  denominators = invariant.pad_axis(denominators, 2, chunks)
  place = jax.vmap(lambda full, part, at: jax.lax.dynamic_update_slice_in_dim(
      full, part, at, axis=1))
  start = cache_lengths // CHUNK
  return _finish(place(numerators, edge_numerators, start),
                 place(denominators, edge_denominators, start))


def invariant_cache_attention(q, k_cache, v_cache, cache_lengths, k_block, v_block, block_mask,
                              *, scale):
  """`attention.full_cache_attention`'s contract, batch-invariant (see the module doc)."""
  batch, t_len, num_heads, head_dim = q.shape
  num_kv = k_block.shape[2]
  groups = num_heads // num_kv
  qg = q.reshape(batch, t_len, num_kv, groups, head_dim).transpose(0, 2, 1, 3, 4)
  # Scaled before the dot: a scale after it would be a product feeding the softmax's
  # subtraction, which XLA may or may not contract (invariant.py).
  qg = qg.reshape(batch, num_kv, t_len * groups, head_dim) * scale
  keys = k_block.transpose(0, 2, 3, 1)                                 # [B, KVH, Dh, T]
  values = v_block.transpose(0, 2, 1, 3)                               # [B, KVH, T, Dh]
  if v_cache.shape[2] == 0:
    visible = jnp.repeat(block_mask, groups, axis=1)[:, None]
    out = block_only_attention(qg, keys, values, visible)
  else:
    out = cached_attention(qg, k_cache, v_cache, cache_lengths, keys, values, block_mask)
  out = out.reshape(batch, num_kv, head_dim, t_len, groups).transpose(0, 3, 1, 4, 2)
  return out.reshape(batch, t_len, num_heads, head_dim)
