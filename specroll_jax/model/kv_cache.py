"""Static-shape KV cache with per-row lengths, and the commit of a block's keys/values."""
import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class KVCache:
  """Keys/values of every layer: [L, B, KVH, S, Dh]; `lengths[b]` slots of row b are valid."""
  k: jax.Array
  v: jax.Array
  lengths: jax.Array

  @classmethod
  def zeros(cls, config, batch: int, max_length: int) -> 'KVCache':
    shape = (config.num_layers, batch, config.num_kv_heads, max_length, config.head_dim)
    return cls(k=jnp.zeros(shape, config.jnp_dtype), v=jnp.zeros(shape, config.jnp_dtype),
               lengths=jnp.zeros((batch,), jnp.int32))

  @property
  def max_length(self) -> int:
    return self.k.shape[3]

  def take(self, rows: jax.Array) -> 'KVCache':
    """The cache of batch rows `rows` (the batch is axis 1 of k and v, axis 0 of lengths)."""
    return KVCache(k=self.k[:, rows], v=self.v[:, rows], lengths=self.lengths[rows])


@struct.dataclass
class BlockKV:
  """Keys/values a forward computed for its query block: [L, B, T, KVH, Dh]."""
  k: jax.Array
  v: jax.Array


def commit(cache: KVCache, block: BlockKV, source_index: jax.Array, count: jax.Array) -> KVCache:
  """Appends block entries to each row's cache at that row's own length.

  Row b appends `block[:, b, source_index[b, i]]` for i < count[b] at slot lengths[b] + i.
  Speculative verification passes the accepted tree path as `source_index`; rejected nodes
  are simply never written. Writes past the end of the cache are dropped, never wrapped.
  """
  batch, width = source_index.shape
  offsets = jnp.arange(width)[None, :]
  slots = jnp.where(offsets < count[:, None], cache.lengths[:, None] + offsets, cache.max_length)
  rows = jnp.broadcast_to(jnp.arange(batch)[:, None], (batch, width))
  # Advanced indices (rows, slots) around a slice move to the front: values are [B, W, L, KVH, Dh].
  gather = lambda x: jnp.take_along_axis(
      x, source_index[None, :, :, None, None], axis=2).transpose(1, 2, 0, 3, 4)
  k = cache.k.at[:, rows, :, slots].set(gather(block.k), mode='drop')
  v = cache.v.at[:, rows, :, slots].set(gather(block.v), mode='drop')
  return KVCache(k=k, v=v, lengths=jnp.minimum(cache.lengths + count, cache.max_length))
