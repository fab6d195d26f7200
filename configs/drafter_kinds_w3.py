"""The sequential against the context-attending drafter on W3, trained on the same generations.

  python -m experiments.measure.drafter_kinds --config=configs/drafter_kinds_w3.py

Both kinds are trained on one set of the policy's own T = 1 answers to GSM8K *train*
questions (c.kinds_pairs: a third of the drafts_w3 drafter's 768, so that both recipes and
the measurement fit an hour on a 2-core CPU) with the same steps, batches, draft vocabulary
and seed (c.drafter's), and measured on drafts_w3's held-out GSM8K *test* questions.
"""
import ml_collections

from configs.drafts_w3 import get_config as drafts_config


def get_config():
  c = drafts_config()
  c.kinds_pairs = ml_collections.ConfigDict(dict(
      prompts='gsm8k', num_sequences=256, held_out=32, max_new_tokens=256, seed=0))
  c.context_heads = 4               # the context drafter's attention heads (of 64 dims)
  c.kinds_dir = 'workdir/drafter_kinds_w3'
  c.kind_cells = ((16, 1), (4, 16))  # (nodes per row, responses in flight), T = c.temperature
  c.out_dir = 'results/drafts_w3/drafter_kinds'
  return c
