"""Drafter adaptation under a real model's GRPO drift: configs/adaptation_smol.py with the
sequential drafter drafting instead of the heads.

  python3 -m experiments.import_gguf --out=workdir/models/smollm2-135m-instruct
  python3 -m experiments.bench.drafts --config=configs/drafts_w3.py  (warm-starts the drafter)
  python3 -m experiments.bench.adaptation --config=configs/adaptation_smol_drafter.py

The drafter is W3's (configs/bench_w3.py drafter_dir: 768 of the policy's own GSM8K train
answers, 400 steps, an 8,192-token draft vocabulary), each variant starting from a copy. Its
spine has the heads' candidates per depth (4, 2, 2, 1), so the two ablations draft trees of
the same shape. Reflex does not apply to the drafter, so the variants are static, slow
and online.

The block's updates run at 2e-4, its warm start's last learning rate (cosine from 2e-3 to a
tenth), not at the heads' 1e-3: at 1e-3 every update lowered the drafter's tau (slow: 1.51 ->
1.36 after its first update, online 1.54 -> 1.40 at step 2; results/adaptation_smol_drafter/
lr_1e-3), as the first steps of fresh Adam moments move all 2.0 M weights by about the
learning rate, a few percent of their scale, in the sign of one small batch's gradient.
"""
from configs.adaptation_smol import get_config as heads_config


def get_config():
  c = heads_config()
  c.rollout.proposers = 'drafter'
  c.drafter.branching = (4, 2, 2, 1)
  c.initial_heads = 'workdir/drafter_smollm2_gsm8k'
  for section in (c.adaptation.consolidation, c.adaptation.online):
    section.learning_rate = 2e-4
  c.variants = ('static', 'slow', 'online')
  c.out_dir = 'results/adaptation_smol_drafter'
  c.workdir = 'workdir/adaptation_smol_drafter'
  return c
