"""W1 adaptation ablation: one seeded GRPO run per head-adaptation variant.

  python -m experiments.bench.adaptation --config=configs/ablation_w1.py

The GRPO learning rate is raised over the main job's so the policy drifts measurably
within the run (drift_kl: KL(current || initial) on each batch's own tokens). A fixed
verification capacity keeps trees of several nodes per response on a CPU, so acceptance
(and its decay) is visible; vanilla runs too, for the speedups.
"""
from configs.tiny_math import get_config as base_config


def get_config():
  c = base_config()
  c.steps = 60
  c.checkpoint_every = 60
  c.rollout.prompts_per_step = 8
  c.rollout.driver.max_batch = 64
  c.rollout.tree.capacity_tokens = 512
  # Every step verifies a tree, so each variant's heads are measured at every step.
  c.rollout.speculation_gate = False
  # The heads alone, as its committed results were measured; group drafts on W1 are
  # measured in results/group_drafts (and with --config.rollout.proposers=heads,group).
  c.rollout.proposers = 'heads'
  c.grpo.learning_rate = 3e-4
  c.metrics.drift_kl_every = 1
  c.variants = ('static', 'online', 'reflex', 'slow', 'both')
  c.include_vanilla = True
  # Heads every variant starts from (a copy); '' = the first variant warm-starts them.
  c.initial_heads = ''
  # The task its committed results were measured on (the main job now cycles 64 easy tasks).
  c.task.source, c.task.count = 'synthetic:hard', 4096
  c.audit.every = 0  # vanilla runs as its own variant
  c.window = 20  # steps averaged into tau_first20 / tau_last20
  c.repeats = 2  # runs of every variant, in alternating order; times are their medians
  c.warmup_steps = 5  # excluded from the times: they compile the engines' shapes
  c.out_dir = 'results/ablation_w1'
  c.workdir = 'workdir/ablation_w1'
  return c
