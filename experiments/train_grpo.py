"""GRPO with SpecRoll (or vanilla) rollouts; resumes from workdir/checkpoints if present.

  python -m experiments.train_grpo --config=configs/tiny_math.py --workdir=workdir/tiny_math
  python -m experiments.train_grpo --config=configs/tiny_math.py --workdir=... \
      --config.rollout.engine=vanilla --config.steps=20
"""
from absl import app, flags
from ml_collections import config_flags

from specroll_jax.rl.trainer import train

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/tiny_math.py')
flags.DEFINE_string('workdir', 'workdir/tiny_math', 'Run directory (metrics, checkpoints, report).')
FLAGS = flags.FLAGS


def main(argv):
  del argv
  last = train(_CONFIG.value, FLAGS.workdir)
  print(f"done: step {last.get('step')}, reward {last.get('reward', float('nan')):.3f}, "
        f"tau {last.get('tau', float('nan')):.2f}; report in {FLAGS.workdir}/report.md")


if __name__ == '__main__':
  app.run(main)
