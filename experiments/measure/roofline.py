"""The decode step's roofline on this machine, measured rather than taken from a datasheet.

A vanilla decode step at batch B must at least read every weight and the filled KV cache
once, and do 2 FLOPs per parameter per row (plus attention over the cache). Its lower bound
is max(bytes / bandwidth, FLOPs / matmul rate), with bandwidth and matmul rate measured here
by jitted probes: a reduction over an array far larger than the caches, and a large float32
matmul. The bound ignores launch and loop overheads, so no engine reaches it.
"""
import time

import jax
import jax.numpy as jnp

from specroll_jax.model.config import ModelConfig


def call_seconds(fn, *args, repeats: int) -> list[float]:
  """Seconds of `repeats` calls of a jitted fn, after one call that compiles it."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return times


def _best_seconds(fn, *args, repeats: int = 5) -> float:
  return min(call_seconds(fn, *args, repeats=repeats))


def measured_bandwidth(num_bytes: int = 1 << 30) -> float:
  """Bytes/s of a jitted float32 sum over `num_bytes`."""
  x = jnp.ones((num_bytes // 4,), jnp.float32)
  return num_bytes / _best_seconds(jax.jit(jnp.sum), x)


def measured_matmul_rate(size: int = 2048) -> float:
  """FLOP/s of a jitted float32 [size, size] x [size, size] matmul."""
  a = jnp.ones((size, size), jnp.float32)
  return 2 * size ** 3 / _best_seconds(jax.jit(jnp.dot), a, a)


def decode_roofline(config: ModelConfig, num_params: int, batch: int, cache_slots: int) -> dict:
  """The step's lower bound at `batch` rows with `cache_slots` filled slots per row."""
  weight_bytes = num_params * jnp.dtype(config.jnp_dtype).itemsize
  kv_values = 2 * config.num_layers * config.num_kv_heads * config.head_dim * cache_slots
  cache_bytes = batch * kv_values * jnp.dtype(config.activation_dtype).itemsize
  # Every weight is a matmul operand except an untied input embedding (a row gather).
  matmul_params = num_params - (0 if config.tie_word_embeddings
                                else config.vocab_size * config.hidden_size)
  matmul_flops = 2 * batch * matmul_params
  # Scores and weighted values: 2 products of [H, Dh] x [Dh, S] per layer and row.
  attention_flops = 2 * 2 * batch * config.num_layers * config.num_heads * config.head_dim * (
      cache_slots)
  bandwidth, matmul_rate = measured_bandwidth(), measured_matmul_rate()
  memory_s = (weight_bytes + cache_bytes) / bandwidth
  compute_s = (matmul_flops + attention_flops) / matmul_rate
  step_s = max(memory_s, compute_s)
  return dict(batch=batch, cache_slots=cache_slots, weight_bytes=weight_bytes,
              cache_bytes=cache_bytes, flops=matmul_flops + attention_flops,
              bandwidth_bytes_per_s=bandwidth, matmul_flops_per_s=matmul_rate,
              memory_seconds=memory_s, compute_seconds=compute_s, step_seconds=step_s,
              bound='memory' if memory_s >= compute_s else 'compute',
              tokens_per_s=batch / step_s,
              how=('max(weights + filled KV cache bytes / measured bandwidth (jitted sum of '
                   '1 GiB), FLOPs / measured float32 matmul rate (jitted 2048^3 matmul))'))


if __name__ == '__main__':
  from absl import app, flags
  flags.DEFINE_string('checkpoint', 'workdir/models/smollm2-135m-instruct', 'HF directory.')
  flags.DEFINE_integer('batch', 16, 'Rows per decode step.')
  flags.DEFINE_integer('cache_slots', 270, 'Filled cache slots per row.')

  def main(argv):
    del argv
    from specroll_jax import load_policy
    policy = load_policy(flags.FLAGS.checkpoint)
    num_params = sum(x.size for x in jax.tree.leaves(policy.params))
    result = decode_roofline(policy.config, num_params, flags.FLAGS.batch,
                             flags.FLAGS.cache_slots)
    for key, value in result.items():
      print(f'{key}: {value:.4g}' if isinstance(value, float) else f'{key}: {value}')

  app.run(main)
