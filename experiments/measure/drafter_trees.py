"""Drafter trees chosen from the drafter's own rank paths, and what they are worth.

  python -m experiments.measure.drafter_trees --out_dir=results/drafts_w3/drafter_trees

Teacher-forced along the policy's own T = 1 answers, the drafter ranks each drawn token in
its law at each depth. Along drawn tokens the teacher-forced law is the one the drafter
drafts from in the tree, and the draws are the policy's (it wrote the answers), so a T = 1
walk of a rank-path tree accepts depth d exactly when the draws' ranks (r_1..r_d) form a
path of the tree (experiments.lib.rank_trees). The best N-node tree holds the N - 1 most
frequent rank paths; it is chosen on one half of the answers and measured on the other,
both ways, beside the best spine (every rank but the last 0: DrafterProposer's first
shape). Those taus are of trees used whole. In the engine a tree is a pool of candidates
from which each row keeps its best N - 1 by the drafter's own path scores, which a rank
path cannot replay: the pools larger than the budgets are for that (experiments.bench.drafts
measures them). The trees chosen on all answers go to results.json's `trees`
(configs/drafts_w3.py: drafter_trees, drafter_tree_pools).

The answers are to GSM8K train questions from index --first on: neither the heads (the
first 544) nor the drafter (the first 800) were trained or held out on them.
"""

import numpy as np
from absl import app, flags

from experiments.lib.rank_trees import (RANKS, best_tree, drafter_answer_paths, held_out_tau,
                                   is_spine)
from specroll_jax import load_policy
from specroll_jax.adapt.distill import WarmStart, generated_pairs
from specroll_jax.speculative.drafter import load_drafter
from specroll_jax.tasks.sources import load_tasks
from experiments.lib.results import Result, Table, command_line, write

_CHECKPOINT = flags.DEFINE_string('checkpoint', 'workdir/models/smollm2-135m-instruct',
                                  'An HF policy directory.')
_DRAFTER = flags.DEFINE_string('drafter_dir', 'workdir/drafter_smollm2_gsm8k',
                               'The drafter (experiments.train_heads --proposer=drafter).')
_FIRST = flags.DEFINE_integer('first', 800, 'First GSM8K train question used.')
_ANSWERS = flags.DEFINE_integer('answers', 64, 'T=1 answers, one per question.')
_MAX_NEW_TOKENS = flags.DEFINE_integer('answer_tokens', 256, 'Tokens per answer at most.')
_DATA_DIR = flags.DEFINE_string('gsm8k_dir', None, 'Data directory (default ../shared/data).')
_SAMPLING_SEED = flags.DEFINE_integer('sampling_seed', 1, 'Seed of the answers\' draws.')
_OUT_DIR = flags.DEFINE_string('trees_out_dir', 'results/drafts_w3/drafter_trees',
                               'Where results go.')
# Nodes per tree, root included: experiments.bench.drafts' budgets, and candidate pools
# for them.
TREE_NODES = (4, 8, 16, 32, 48, 64)


def main(argv):
  del argv
  policy = load_policy(_CHECKPOINT.value)
  config, drafter = load_drafter(_DRAFTER.value, policy.config)
  first, count = _FIRST.value, _ANSWERS.value
  tasks = load_tasks('gsm8k', count=first + count, seed=0, data_dir=_DATA_DIR.value,
                     split='train', chat=True)[first:first + count]
  if len(tasks) < count:
    raise ValueError(f'GSM8K train has {first + len(tasks)} questions: --first={first} with '
                     f'--answers={count} runs past them')
  prompts = [policy.prompt_ids(t.prompt, True) for t in tasks]
  plan = WarmStart(num_sequences=count // 2, held_out=count - count // 2,
                   max_new_tokens=_MAX_NEW_TOKENS.value, temperature=1.0,
                   seed=_SAMPLING_SEED.value)
  halves = [drafter_answer_paths(config, drafter, policy, pairs)
            for pairs in generated_pairs(policy, prompts, plan, top_k=1)]
  every = halves[0] + halves[1]
  first_ranks = np.array([p[0] if p else RANKS for p in every])
  result = {
      'checkpoint': _CHECKPOINT.value, 'drafter_dir': _DRAFTER.value,
      'questions': f'gsm8k:train[{first}:{first + count}]', 'positions': len(every),
      # How often the drawn x_{t+2} is the drafter's rank r at depth 1 (RANKS: a miss).
      'depth1_rank_rate': {str(r): float(np.mean(first_ranks == r)) for r in range(RANKS + 1)},
      'held_out_tau': {str(nodes): {'best_tree': held_out_tau(halves, nodes),
                                    'best_spine': held_out_tau(halves, nodes, is_spine)}
                       for nodes in TREE_NODES},
      'trees': {str(nodes): sorted(best_tree(every, nodes), key=lambda p: (len(p), p))
                for nodes in TREE_NODES},
  }
  write(Result(
      'Drafter trees from its own rank paths (held-out tau, no proposing cost)',
      command_line('experiments.measure.drafter_trees'), result,
      body=[f'{result["positions"]} positions of {count} T=1 answers to {result["questions"]}; '
            'each tree chosen on one half, measured on the other.',
            Table(['nodes/row', 'best spine', 'best tree'],
                  [[n, f'{t["best_spine"]:.2f}', f'{t["best_tree"]:.2f}']
                   for n, t in result['held_out_tau'].items()])]), _OUT_DIR.value)


if __name__ == '__main__':
  app.run(main)
