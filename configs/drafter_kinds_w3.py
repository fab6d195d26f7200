"""The sequential against the context-attending drafter on W3, trained on the same generations,
and the sequential drafter reading layer features against it.

  python -m experiments.measure.drafter_kinds --config=configs/drafter_kinds_w3.py
  python -m experiments.measure.drafter_features --config=configs/drafter_kinds_w3.py

Both kinds are trained on one set of the policy's own T = 1 answers to GSM8K *train*
questions with the same steps, batches, learning rate, draft vocabulary and seed, and
measured on drafts_w3's held-out GSM8K *test* questions. The recipe is a sixth of the
drafts_w3 drafter's (c.kinds_pairs: 128 answers, not 768; c.kinds_training: 200 steps of 8,
not 400 of 16), so that both trainings and the cells fit an hour on a 2-core AMD EPYC, where
one step of 16 sequences took 7.3 s. Proposing costs are timings: with c.kinds_costs they are
measured before the cells, on an otherwise idle machine.
"""
import ml_collections

from configs.drafts_w3 import get_config as drafts_config


def get_config():
  c = drafts_config()
  c.kinds_pairs = ml_collections.ConfigDict(dict(
      prompts='gsm8k', num_sequences=128, held_out=16, max_new_tokens=256, seed=0))
  c.kinds_training = ml_collections.ConfigDict(dict(steps=200, batch_size=8,
                                                    learning_rate=2e-3))
  c.kinds_costs = True
  c.context_heads = 4               # the context drafter's attention heads (of 64 dims)
  c.kinds_dir = 'workdir/drafter_kinds_w3'
  c.kind_cells = ((16, 1), (4, 16))  # (nodes per row, responses in flight), T = c.temperature
  # Trees both kinds draft, by name: how many nodes per depth each row expands, best path
  # first (() = the spine itself: each depth's top-k below the best guess).
  c.kind_trees = ml_collections.ConfigDict(dict(spine=(), best_first=(2, 2, 2),
                                                best_first_wide=(4, 4, 4)))
  c.out_dir = 'results/drafts_w3/drafter_kinds'
  # experiments.measure.drafter_features: decoder layers (of SmolLM2's 30) fused with h_t at
  # the sequential drafter's input, one trained variant per set (EAGLE-3: low and mid beside
  # the final state).
  c.feature_layer_sets = ((2, 15),)
  c.feature_kinds = ('drafter',)  # and 'context_drafter': both fuse the layers at their input
  c.features_out_dir = 'results/drafts_w3/drafter_features'
  return c
