"""GRPO with SpecRoll (or vanilla) rollouts; resumes from workdir/checkpoints if present.

  python -m experiments.train_grpo --config=configs/tiny_math.py --workdir=workdir/tiny_math
  python -m experiments.train_grpo --config=configs/tiny_math.py --workdir=... \
      --config.rollout.engine=vanilla --config.steps=20

Several processes (README, "Scaling out"): the same command in every process, with
--coordinator_address=HOST:PORT --num_processes=N --process_id=I, or --cluster on TPU pods,
SLURM and Open MPI, where JAX finds them itself.
"""
from absl import app, flags
from ml_collections import config_flags

from specroll_jax.rl import distributed
from specroll_jax.rl.resources import restart_with_large_frees_returned
from specroll_jax.rl.trainer import train

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/tiny_math.py')
flags.DEFINE_string('workdir', 'workdir/tiny_math', 'Run directory (metrics, checkpoints, report).')
flags.DEFINE_string('coordinator_address', '', 'HOST:PORT of process 0 (multi-process runs).')
flags.DEFINE_integer('num_processes', 0, 'Processes in the run (with --coordinator_address).')
flags.DEFINE_integer('process_id', -1, 'This process, 0..num_processes-1.')
flags.DEFINE_bool('cluster', False, 'Join the processes JAX detects (TPU pod, SLURM, Open MPI).')
FLAGS = flags.FLAGS


def main(argv):
  del argv
  if _CONFIG.value.return_large_frees:
    restart_with_large_frees_returned()
  distributed.initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id,
                         cluster=FLAGS.cluster)
  last = train(_CONFIG.value, FLAGS.workdir)
  print(f"done: step {last.get('step')}, reward {last.get('reward', float('nan')):.3f}, "
        f"tau {last.get('tau', float('nan')):.2f}; report in {FLAGS.workdir}/report.md")


if __name__ == '__main__':
  app.run(main)
