"""Measures the verification capacity C_hw of a policy on this machine and caches it.

  python -m experiments.profile.capacity --checkpoint=specroll_jax/tasks/stories260K

Always measures afresh (replacing any cached profile for this model and hardware), then
prints latency against total tokens per batch and the chosen C_hw.
"""
from absl import app, flags

from experiments.lib.common import DEFAULT_CHECKPOINT
from specroll_jax import load_policy
from specroll_jax.speculative.capacity import MAX_SPREAD, baselines, measure_capacity, save_profile

flags.DEFINE_string('checkpoint', str(DEFAULT_CHECKPOINT), 'HF-format policy directory.')
flags.DEFINE_integer('max_batch', 64, 'Largest batch; max_batch / 2, / 4, / 8 are also measured.')
flags.DEFINE_integer('max_nodes', 64, 'Largest node count per row (N_max).')
flags.DEFINE_float('knee_factor', 1.3, 'Latency ratio to the decode step that marks the knee.')
flags.DEFINE_integer('cache_length', 256, 'KV cache slots per row (half of them filled).')
flags.DEFINE_integer('repeats', 5, 'Timed runs per shape; the median is kept.')
flags.DEFINE_enum('dtype', 'float32', ['float32', 'bfloat16'], 'Parameter dtype.')
flags.DEFINE_string('cache_dir', None,
                    'Profile directory (default: $SPECROLL_CAPACITY_DIR or '
                    '~/.cache/specroll_jax/capacity).')
FLAGS = flags.FLAGS


def main(argv):
  del argv
  policy = load_policy(FLAGS.checkpoint, dtype=FLAGS.dtype, with_tokenizer=False)
  batches = sorted({max(1, FLAGS.max_batch >> i) for i in range(4)}, reverse=True)
  profile = measure_capacity(
      policy.config, policy.params, batches=batches, max_nodes=FLAGS.max_nodes,
      cache_length=FLAGS.cache_length, knee_factor=FLAGS.knee_factor, repeats=FLAGS.repeats)
  path = save_profile(profile, FLAGS.cache_dir)
  base = baselines(profile.measurements)
  print(f'{"batch":>6} {"nodes":>6} {"tokens":>7} {"latency_ms":>11} {"ratio":>6} {"spread":>7}')
  for batch, nodes, total, ms, spread in profile.measurements:
    print(f'{batch:6d} {nodes:6d} {total:7d} {ms:11.3f} {ms / base[batch]:6.2f} {spread:7.3f}')
  print(f'C_hw = {profile.capacity_tokens} tokens (knee factor {profile.knee_factor}; '
        f'{profile.backend} / {profile.device_kind}, {profile.dtype}, {profile.software})')
  busy = ' (busy: a rollout that loads it measures again)' if profile.busy() else ''
  print(f'median relative spread {profile.spread:.3f}, limit {MAX_SPREAD}{busy}')
  print('per batch (used by default): ' + ', '.join(
      f'B={b}: C_hw={tokens}, N_t={min(tokens // b, FLAGS.max_nodes)}'
      for b, tokens in profile.capacity_by_batch()))
  print(f'wrote {path}')


if __name__ == '__main__':
  app.run(main)
