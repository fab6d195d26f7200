"""Static-shape KV cache with per-row lengths, and the commit of a block's keys/values."""
import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class KVCache:
  """Keys per layer: a tuple of L arrays [B, KVH, Dh, S]; values: L arrays [B, KVH, S, Dh];
  `lengths[b]` slots of row b are valid.

  Head-major, so the attention products are plain batched matmuls without a transpose of
  the cache per step: scores are q [T*G, Dh] @ K [Dh, S] and outputs P [T*G, S] @ V [S, Dh].
  Keys stored slot-major ([.., S, Dh]) made XLA:CPU run the score product as a
  transposed-operand matmul: W3's decode step at 16 rows and 512 slots took 128.5 ms
  against 107.1 ms with keys [Dh, S] (notes/history.md, "Vanilla decode on W3"). One buffer
  per layer, not one stacked [L, ...] array: XLA:CPU copied a layer's slice of a stacked
  array before the products read it (score products 65 ms per step instead of 18 ms).
  """
  k: tuple
  v: tuple
  lengths: jax.Array

  @classmethod
  def zeros(cls, config, batch: int, max_length: int) -> 'KVCache':
    heads, dim, dtype = config.num_kv_heads, config.head_dim, config.cache_dtype
    layers = lambda shape: tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers))
    return cls(k=layers((batch, heads, dim, max_length)), v=layers((batch, heads, max_length, dim)),
               lengths=jnp.zeros((batch,), jnp.int32))

  @property
  def max_length(self) -> int:
    return self.v[0].shape[2]


@struct.dataclass
class BlockKV:
  """Keys/values a forward computed for its query block: tuples of L arrays [B, T, KVH, Dh]."""
  k: tuple
  v: tuple


def commit(cache: KVCache, block: BlockKV, source_index: jax.Array, count: jax.Array) -> KVCache:
  """Appends block entries to each row's cache at that row's own length.

  Row b appends every layer's `block[b, source_index[b, i]]` for i < count[b] at slot lengths[b] + i.
  Speculative verification passes the accepted tree path as `source_index`; rejected nodes
  are simply never written. Writes past the end of the cache are dropped, never wrapped.
  """
  batch, width = source_index.shape
  offsets = jnp.arange(width)[None, :]
  slots = jnp.where(offsets < count[:, None], cache.lengths[:, None] + offsets, cache.max_length)
  rows = jnp.broadcast_to(jnp.arange(batch)[:, None], (batch, width))
  selected = lambda layer_block: jnp.take_along_axis(
      layer_block, source_index[:, :, None, None], axis=1)
  # Advanced indices (rows, slots) separated by slices move to the front, so both writes
  # take values [B, W, KVH, Dh].
  k = tuple(layer.at[rows, :, :, slots].set(selected(new), mode='drop')
            for layer, new in zip(cache.k, block.k))
  v = tuple(layer.at[rows, :, slots].set(selected(new), mode='drop')
            for layer, new in zip(cache.v, block.v))
  return KVCache(k=k, v=v, lengths=jnp.minimum(cache.lengths + count, cache.max_length))
