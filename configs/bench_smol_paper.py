"""configs/smol_grpo_paper.py's job with vanilla and SpecRoll rollouts, stepped in turn.

  python -m experiments.measure.drafter_kinds --config=configs/drafter_kinds_w3.py
  python -m experiments.bench.e2e --config=configs/bench_smol_paper.py

The first command trains the sequential drafter this benchmark places into the SpecRoll run
(c.proposer_dir; the job's own warm start is the same recipe on other answers). Add
'specroll:static' and 'specroll:online' to c.variants for the drafter's tau over steps
without and with retraining after every step (each variant is one more run in turn).
"""
from configs.smol_grpo_paper import get_config as job_config


def get_config():
  c = job_config()
  c.steps = 4
  c.checkpoint_every = c.steps
  c.variants = ('vanilla', 'specroll')
  # The side-by-side compares every step's rollout with vanilla's; the held-out evaluation
  # is the job's, not the engines'.
  c.audit.every = 0
  c.evaluation.every = 0
  c.proposer_dir = 'workdir/drafter_kinds_w3/drafter'
  c.workdir = 'workdir/bench_smol_paper'
  c.out_dir = 'results/smol_grpo_paper'
  return c
