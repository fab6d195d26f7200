"""Reflex under a drift between the W1 ablation's and the notebook's: GRPO at lr 1e-3.

  python -m experiments.bench.adaptation --config=configs/adaptation_w1_drift.py

The ablation (lr 3e-4, 60 steps) moves the W1 policy by KL ~1 nat/token and Reflex's gates
stay shut; the notebook's episode (lr 3e-3, 10 steps) reaches KL ~6. This run sits between
them, with static heads as the paired reference (both emit the same tokens, so their tau
differs only by what Reflex drafts).
"""
from configs.ablation_w1 import get_config as ablation_config


def get_config():
  c = ablation_config()
  c.steps = 30
  c.checkpoint_every = 30
  c.grpo.learning_rate = 1e-3
  c.variants = ('static', 'reflex')
  c.include_vanilla = False
  c.repeats = 1
  c.window = 10
  c.out_dir = 'results/adaptation_w1_drift'
  c.workdir = 'workdir/adaptation_w1_drift'
  return c
