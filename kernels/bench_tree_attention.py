"""Times the Pallas tree-attention kernel against the XLA reference `block_attention`.

  python -m kernels.bench_tree_attention [--dtype bfloat16] [--block_s 128] [--iters N]

Runs on whatever backend JAX picks. On CPU the kernel goes through the Pallas
interpreter, so its times there only show that it runs, not how fast it is.
"""
import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from kernels.tree_attention import tree_attention
from specroll_jax.model.attention import block_attention


def random_inputs(rng, batch, s_len, t_len, heads, kv_heads, head_dim, min_fill, dtype):
  normal = lambda *dims: jnp.asarray(rng.standard_normal(dims, np.float32), dtype)
  # Random trees: each block token hangs off an earlier one (or off the cache, -1).
  masks = np.zeros((batch, t_len, t_len), bool)
  for b in range(batch):
    masks[b] = np.eye(t_len, dtype=bool)
    for i in range(1, t_len):
      parent = rng.integers(-1, i)
      if parent >= 0:
        masks[b, i] |= masks[b, parent]
  lengths = rng.integers(int(min_fill * s_len), s_len + 1, batch)
  return dict(
      q=normal(batch, t_len, heads, head_dim),
      k_cache=normal(batch, kv_heads, head_dim, s_len),
      v_cache=normal(batch, kv_heads, s_len, head_dim),
      cache_lengths=jnp.asarray(lengths, jnp.int32),
      k_block=normal(batch, t_len, kv_heads, head_dim),
      v_block=normal(batch, t_len, kv_heads, head_dim),
      block_mask=jnp.asarray(masks),
  )


def median_seconds(fn, inputs, iters):
  fn(**inputs).block_until_ready()  # compile
  times = []
  for _ in range(iters):
    start = time.perf_counter()
    fn(**inputs).block_until_ready()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--batch', type=int, nargs='+', default=[8, 64])
  parser.add_argument('--tokens', type=int, nargs='+', default=[1, 16, 64],
                      help='block tokens T (tree size)')
  parser.add_argument('--cache', type=int, default=1024, help='cache slots S')
  parser.add_argument('--heads', type=int, default=8)
  parser.add_argument('--kv_heads', type=int, default=4)
  parser.add_argument('--head_dim', type=int, default=64)
  parser.add_argument('--min_fill', type=float, default=0.5,
                      help='cache lengths are drawn uniformly from [min_fill * S, S]')
  parser.add_argument('--dtype', choices=['float32', 'bfloat16'], default='float32')
  parser.add_argument('--block_s', type=int, default=128)
  parser.add_argument('--iters', type=int, default=None,
                      help='timed calls, the median is shown (default 20; 3 on CPU, where '
                      'the interpreted kernel takes seconds per call)')
  parser.add_argument('--seed', type=int, default=0)
  args = parser.parse_args()

  backend = jax.default_backend()
  interpreted = backend == 'cpu'
  if args.iters is None:
    args.iters = 3 if interpreted else 20
  print(f'backend: {backend} ({jax.devices()[0].device_kind}), dtype {args.dtype}, '
        f'S={args.cache}, H={args.heads}, KVH={args.kv_heads}, Dh={args.head_dim}, '
        f'block_s={args.block_s}, median of {args.iters}')
  if interpreted:
    print('NOTE: on CPU the kernel runs in the Pallas interpreter; its times are not a '
          'performance measurement, only a check that it runs.')

  scale = args.head_dim ** -0.5
  reference = jax.jit(lambda **kw: block_attention(**kw, scale=scale))
  kernel = jax.jit(lambda **kw: tree_attention(**kw, scale=scale, block_s=args.block_s))
  rng = np.random.default_rng(args.seed)
  bytes_per = jnp.dtype(args.dtype).itemsize
  header = (f'{"B":>4} {"T":>4} {"reference ms":>13} {"kernel ms":>11} {"speedup":>8} '
            f'{"kernel GB/s":>12} {"max |diff|":>11}')
  print(header)
  print('-' * len(header))
  for batch in args.batch:
    for t_len in args.tokens:
      inputs = random_inputs(rng, batch, args.cache, t_len, args.heads, args.kv_heads,
                             args.head_dim, args.min_fill, jnp.dtype(args.dtype))
      ref_s = median_seconds(reference, inputs, args.iters)
      ker_s = median_seconds(kernel, inputs, args.iters)
      diff = jnp.max(jnp.abs(kernel(**inputs).astype(jnp.float32) -
                             reference(**inputs).astype(jnp.float32)))
      # Cache bytes the kernel must read (valid slots only, K and V): the memory-bound
      # floor that matters for long caches.
      cache_bytes = 2 * int(inputs['cache_lengths'].sum()) * args.kv_heads * args.head_dim * bytes_per
      print(f'{batch:>4} {t_len:>4} {ref_s * 1e3:>13.3f} {ker_s * 1e3:>11.3f} '
            f'{ref_s / ker_s:>7.2f}x {cache_bytes / ker_s / 1e9:>12.2f} {float(diff):>11.2e}')


if __name__ == '__main__':
  main()
