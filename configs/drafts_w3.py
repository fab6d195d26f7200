"""Draft quality on W3 (SmolLM2-135M-Instruct, GSM8K chat prompts) at fixed node budgets.

  python -m experiments.bench.drafts --config=configs/drafts_w3.py

The heads and the sequential drafter are W3's (configs/bench_w3.py: heads_dir, drafter_dir
and their warm starts); the drafter is self-distilled when missing, on the model's own
T = 1 answers to GSM8K *train* questions (c.drafter; about 30 minutes on a 2-core CPU). Every cell
runs held-out GSM8K *test* questions with every step a tree of `nodes` nodes per row (no
gate): one response in flight (num_prompts questions one at a time), or sixteen (4
questions x 4 samples, kept in one 16-row bucket to the end).
"""
from configs.bench_w3 import get_config as w3_config
from specroll_jax.rl.sections import section
from specroll_jax.speculative.group_proposer import GroupDraftConfig


def get_config():
  c = w3_config()
  c.num_prompts = 4
  c.max_new_tokens = 128
  c.group = section(GroupDraftConfig)
  c.budgets = (4, 8, 16)            # nodes per row, root included
  c.responses = (1, 16)             # responses in flight
  # (nodes, responses) cells also measured greedy; the rest run at c.temperature.
  c.greedy_cells = ((16, 1), (4, 16))
  c.proposers = ('heads', 'drafter', 'drafter_tree', 'heads_group', 'oracle')
  # The drafter's rank-path trees, chosen on its own ranks over answers to GSM8K train
  # questions it was not trained on:
  #   python -m experiments.measure.drafter_trees --trees_out_dir=results/drafts_w3/drafter_trees
  c.drafter_trees = 'results/drafts_w3/drafter_trees/results.json'
  # (nodes per row, the size of the tree whose paths are its candidates)
  c.drafter_tree_pools = ((4, 16), (8, 32), (16, 48))
  c.cost_nodes = 16                 # the tree at which proposing costs are priced (1 row)
  c.out_dir = 'results/drafts_w3'
  return c
