"""Head adaptation under a real model's GRPO drift: the SmolLM2 job (configs/smol_grpo.py)
with the heads drafting every step, once per adaptation variant.

  python3 -m experiments.import_gguf --out=workdir/models/smollm2-135m-instruct
  python3 -m experiments.train_heads ... (the W3 heads: notes/history.md, issue 29)
  python3 -m experiments.bench.adaptation --config=configs/adaptation_smol.py

Every variant emits the same tokens (exactness: their rollout digests are compared), so
each sees the same policy trajectory and the same drift; what differs is the heads' tau
and what keeping them current costs. The held-out evaluation and the audit are off (they
are the job's, in results/smol_grpo), and the gate too, so every step verifies a tree and
measures the heads.
"""
from configs.smol_grpo import get_config as smol_config


def get_config():
  c = smol_config()
  c.rollout.proposers = 'heads'
  c.rollout.speculation_gate = False
  c.rollout.head_drafts.branching = (4, 2, 2, 1)
  c.evaluation.every = 0
  c.audit.every = 0
  c.metrics.drift_kl_every = 1
  # What this compares is tau and head-update time, not memory: the allocator setting would
  # add ~13 s to every update (tiny_math's note).
  c.return_large_frees = False
  # The W3 heads (self-distilled on 192 of the policy's own GSM8K answers, 150 steps;
  # workdir-local, made by experiments.train_heads): each variant starts from a copy.
  c.initial_heads = 'workdir/heads_smollm2_gsm8k'
  c.variants = ('static', 'slow', 'online', 'reflex')
  c.include_vanilla = False
  c.repeats = 1
  c.window = 4
  c.warmup_steps = 1
  c.out_dir = 'results/adaptation_smol'
  c.workdir = 'workdir/adaptation_smol'
  return c
