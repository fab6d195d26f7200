"""Merged LoRA weights or adapters in the forward: which costs the rollout less, measured.

  python -m experiments.measure.lora --out=results/lora

Merged: once per GRPO step, W' = W + (alpha / r) A B for every adapted kernel, then every
decode step reads W' (what the trainer does). In the forward: every decode step computes
x W + (alpha / r) (x A) B for each adapted projection. Both are timed here on the decode
step's own shapes (rows x D inputs through every adapted kernel of the policy, each
projection jitted as a chain over the layers), so the comparison is merge time against
(in-forward step - plain step) x the decode steps of a rollout.
"""
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from absl import app, flags
from flax import traverse_util

from specroll_jax.model.config import config_from_hf, load_config
from specroll_jax.rl import lora
from specroll_jax.rl.memory import param_shapes
from specroll_jax.tasks.default_policy import ensure_default_policy
from experiments.lib.results import Result, Table, command_line, write

flags.DEFINE_integer('rank', 64, 'LoRA rank.')
flags.DEFINE_integer('rows', 16, 'Decode rows (responses running at once).')
flags.DEFINE_integer('decode_steps', 256,
                     'Decode steps per rollout the in-forward cost is paid on.')
flags.DEFINE_integer('repeats', 20, 'Timings per measurement (median kept).')
flags.DEFINE_string('out', 'results/lora', 'Output directory.')
FLAGS = flags.FLAGS
# W3's policy, SmolLM2-135M-Instruct (its config.json's shape fields): random weights of
# its shapes time the same as its own.
W3_ARCHITECTURE = dict(architectures=['LlamaForCausalLM'], vocab_size=49152, hidden_size=576,
                       intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                       num_key_value_heads=3, tie_word_embeddings=True)


def _median_seconds(fn, *args):
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(FLAGS.repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def measure(name: str, config) -> dict:
  key = jax.random.key(0)
  shapes = param_shapes(config)
  params = jax.tree.map(lambda s: jax.random.normal(key, s.shape, jnp.float32) * 0.02, shapes)
  adapters = lora.init_adapters(params, FLAGS.rank, lora.DEFAULT_TARGETS, seed=0)
  adapters = jax.tree.map(lambda x: x + 0.01, adapters)  # a trained B is not zero
  scale = 0.5
  flat, pairs = (traverse_util.flatten_dict(t, sep='/') for t in (params, adapters))
  paths = sorted({p.rsplit('/', 1)[0] for p in pairs})
  kernels = [flat[f'{p}/kernel'] for p in paths]
  a_s = [pairs[f'{p}/lora_a'] for p in paths]
  b_s = [pairs[f'{p}/lora_b'] for p in paths]
  inputs = [jax.random.normal(key, (FLAGS.rows, k.shape[0]), jnp.float32) for k in kernels]

  @jax.jit
  def plain(xs, ws):
    return [x @ w for x, w in zip(xs, ws)]

  @jax.jit
  def in_forward(xs, ws, a_list, b_list):
    return [x @ w + scale * ((x @ a) @ b) for x, w, a, b in zip(xs, ws, a_list, b_list)]

  merge = jax.jit(lora.merge, static_argnums=2)
  plain_s = _median_seconds(plain, inputs, kernels)
  forward_s = _median_seconds(in_forward, inputs, kernels, a_s, b_s)
  merge_s = _median_seconds(merge, params, adapters, scale)
  per_rollout = (forward_s - plain_s) * FLAGS.decode_steps
  return {'model': name, 'rank': FLAGS.rank, 'rows': FLAGS.rows,
          'adapted_kernels': len(paths),
          'projections_plain_ms': plain_s * 1e3, 'projections_in_forward_ms': forward_s * 1e3,
          'in_forward_overhead_per_step': forward_s / plain_s - 1,
          'in_forward_ms_per_rollout': per_rollout * 1e3, 'merge_ms': merge_s * 1e3,
          'faster': 'merged' if merge_s < per_rollout else 'in the forward'}


def main(argv):
  del argv
  models = {'W1 (0.5M)': load_config(ensure_default_policy('workdir/policies')),
            'SmolLM2-135M (W3)': config_from_hf(W3_ARCHITECTURE, Path('W3'))}
  rows = [measure(name, config) for name, config in models.items()]
  table = Table(['model', 'kernels', 'projections ms (plain / in forward)',
                 'in-forward overhead per step', f'x {FLAGS.decode_steps} steps ms', 'merge ms',
                 'faster'],
                [[r['model'], r['adapted_kernels'],
                  f"{r['projections_plain_ms']:.3f} / {r['projections_in_forward_ms']:.3f}",
                  f"{r['in_forward_overhead_per_step']:+.1%}",
                  f"{r['in_forward_ms_per_rollout']:.1f}", f"{r['merge_ms']:.2f}", r['faster']]
                 for r in rows], align='lrrrrrl')
  write(Result('LoRA: merged weights vs adapters in the forward',
               command_line('experiments.measure.lora'), {'models': rows},
               body=[f'Rank {FLAGS.rank}, {FLAGS.rows} decode rows, float32, medians of '
                     f'{FLAGS.repeats}; 2-core CPU.', table]), FLAGS.out)


if __name__ == '__main__':
  app.run(main)
