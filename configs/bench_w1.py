"""W1 end-to-end benchmark: 20 GRPO steps on the synthetic math task, per engine.

  python -m experiments.bench.e2e --config=configs/bench_w1.py
"""
from configs.tiny_math import get_config as base_config


def get_config():
  c = base_config()
  c.steps = 20
  c.checkpoint_every = 20
  c.variants = ('vanilla', 'specroll')
  c.proposer_dir = ''  # '' = each speculative run warm-starts its own heads
  # The heads alone, as its committed results were measured; group drafts on W1 are
  # measured in results/group_drafts (and with --config.rollout.proposers=heads,group).
  c.rollout.proposers = 'heads'
  # The task its committed results were measured on (the main job now cycles 64 easy tasks).
  c.task.source, c.task.count = 'synthetic:hard', 4096
  c.audit.every = 0  # the benchmark runs vanilla itself, as a whole run
  c.out_dir = 'results/bench_e2e_w1'
  c.workdir = 'workdir/bench_e2e_w1'
  return c
