"""Draft quality on W3 (SmolLM2-135M-Instruct, GSM8K chat prompts) at fixed node budgets.

  python -m experiments.bench_drafts --config=configs/drafts_w3.py

The heads are W3's (configs/bench_w3.py: heads_dir and its warm start); the sequential
drafter is self-distilled into drafter_dir when missing, on the model's own T = 1 answers
to GSM8K *train* questions (see c.drafter; about 25 minutes on a 2-core CPU). Every cell
runs held-out GSM8K *test* questions with every step a tree of `nodes` nodes per row (no
gate): one response in flight (num_prompts questions one at a time), or sixteen (4
questions x 4 samples, kept in one 16-row bucket to the end).
"""
import ml_collections

from configs.bench_w3 import get_config as w3_config
from specroll_jax.rl.sections import section
from specroll_jax.spec.group_proposer import GroupDraftConfig


def get_config():
  c = w3_config()
  c.num_prompts = 4
  c.max_new_tokens = 128
  c.drafter_dir = 'workdir/drafter_smollm2_gsm8k'
  c.drafter = ml_collections.ConfigDict(dict(
      prompts='gsm8k', depth=4, hidden_multiplier=2.0, draft_vocab_size=8192,
      num_sequences=768, held_out=32, max_new_tokens=256, steps=400, batch_size=16,
      learning_rate=2e-3, seed=0))
  # Spine candidates per depth: 18, so a 16-node tree chooses among them by path score.
  c.drafter_branching = (8, 4, 4, 2)
  c.group = section(GroupDraftConfig)
  c.budgets = (4, 8, 16)            # nodes per row, root included
  c.responses = (1, 16)             # responses in flight
  # (nodes, responses) cells also measured greedy; the rest run at c.temperature.
  c.greedy_cells = ((16, 1), (4, 16))
  c.proposers = ('heads', 'drafter', 'heads_group', 'oracle')
  c.cost_nodes = 16                 # the tree at which proposing costs are priced (1 row)
  c.out_dir = 'results/drafts_w3'
  return c
