"""Pretrains the W1 policy from scratch on synthetic arithmetic word problems.

  python -m experiments.pretrain_policy --out=workdir/w1_policy

Trains a small Llama (stories260K tokenizer) on prompt + step-by-step solution of mostly
easy and some hard specroll_jax.synthetic_math problems for --max_steps steps, reports
greedy accuracy on held-out easy and hard problems, and saves an HF directory with
pretrain_report.json. With the default flags this is the build of the committed W1 policy
(specroll_jax/tasks/default_policy.py says how it was rebuilt).
"""
import dataclasses
import json
import sys
from pathlib import Path

from absl import app, flags

from experiments.lib.common import DEFAULT_CHECKPOINT
from specroll_jax.tasks.pretrain import PretrainConfig, pretrain

_DEFAULTS = PretrainConfig()

flags.DEFINE_string('out', None, 'Directory to write the policy to.')
flags.DEFINE_bool('overwrite', False, 'Replace a policy already in --out.')
flags.DEFINE_string('tokenizer', str(DEFAULT_CHECKPOINT), 'Directory whose tokenizer to use.')
flags.DEFINE_integer('max_steps', _DEFAULTS.max_steps, 'Optimizer steps.')
flags.DEFINE_integer('hidden_size', _DEFAULTS.hidden_size, 'Model width.')
flags.DEFINE_integer('num_layers', _DEFAULTS.num_layers, 'Decoder layers.')
flags.DEFINE_integer('intermediate_size', _DEFAULTS.intermediate_size, 'MLP width.')
flags.DEFINE_integer('batch_rows', _DEFAULTS.batch_rows, 'Packed rows per step.')
flags.DEFINE_float('learning_rate', _DEFAULTS.learning_rate, 'Peak AdamW learning rate.')
flags.DEFINE_float('hard_fraction', _DEFAULTS.hard_fraction,
                   'Share of hard-split problems in the training pool.')
flags.DEFINE_float('drill_fraction', _DEFAULTS.drill_fraction,
                   'Share of training examples shown as the solution alone.')
flags.DEFINE_integer('eval_problems', _DEFAULTS.eval_problems, 'Held-out problems per split.')
flags.DEFINE_integer('seed', _DEFAULTS.seed, 'Seed for data, init and batching.')
flags.mark_flags_as_required(['out'])
FLAGS = flags.FLAGS


def main(argv):
  del argv
  config = dataclasses.replace(
      _DEFAULTS, max_steps=FLAGS.max_steps,
      hidden_size=FLAGS.hidden_size, num_layers=FLAGS.num_layers,
      intermediate_size=FLAGS.intermediate_size, batch_rows=FLAGS.batch_rows,
      learning_rate=FLAGS.learning_rate, hard_fraction=FLAGS.hard_fraction,
      drill_fraction=FLAGS.drill_fraction, eval_problems=FLAGS.eval_problems, seed=FLAGS.seed)
  try:
    report = pretrain(config, Path(FLAGS.out), overwrite=FLAGS.overwrite,
                      tokenizer_dir=Path(FLAGS.tokenizer))
  except FileExistsError as e:
    sys.exit(f'error: {e}')
  print(f'easy accuracy {report["accuracy_easy"]:.3f}  hard accuracy '
        f'{report["accuracy_hard"]:.3f}  ({report["parameters"]} parameters, '
        f'{report["steps"]} steps in {report["train_seconds"]} s)')
  print('report ' + json.dumps({k: report[k] for k in (
      'accuracy_easy', 'accuracy_hard', 'parameters', 'steps', 'train_seconds',
      'final_loss')}))
  print(f'saved policy to {FLAGS.out}')


if __name__ == '__main__':
  app.run(main)
