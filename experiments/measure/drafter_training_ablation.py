"""Drafter training variants on the same generations, judged on held-out answers.

  python -m experiments.measure.drafter_training_ablation --feature_weights=0,1 \
      --ablation_out_dir=results/drafts_w3/feature_loss

The policy answers GSM8K train questions at T = 1 once; every variant trains a drafter from
the same initial weights and draft vocabulary on the same answers and batches, and differs
only in DrafterTraining.feature_weight (EAGLE's regression of the drafter's state onto the
policy's next hidden state, beside the soft cross-entropy). Each is judged on held-out
answers by its teacher-forced top-1 agreement with the drawn token, the policy's
probability of its top-1 draft (the chance a T = 1 walk accepts it), and the tau of its best
static spine and tree at 4 and 16 nodes chosen on one half of the held-out answers and
measured on the other (experiments.lib.rank_trees: trees used whole, no proposing cost). The
held-out smooth L1 distance of each depth's state to the policy's hidden state is reported
beside them.
"""
import dataclasses
import json
import sys
import time

import jax
import numpy as np
from absl import app, flags

from experiments.lib.rank_trees import drafter_answer_paths, held_out_tau, is_spine
from specroll_jax import load_policy
from specroll_jax.adapt.distill import WarmStart, generated_pairs
from specroll_jax.adapt.drafter_training import (DrafterTraining, agreement_rates,
                                                 feature_distances, train_drafter)
from specroll_jax.speculative.drafter import DrafterConfig
from specroll_jax.tasks.sources import load_tasks

from experiments.lib.results import Figure, Result, Table, command_line, write

_CHECKPOINT = flags.DEFINE_string('checkpoint', 'workdir/models/smollm2-135m-instruct',
                                  'An HF policy directory (an instruct model: chat prompts).')
_DATA_DIR = flags.DEFINE_string('gsm8k_dir', None, 'Data directory (default ../shared/data).')
_TRAIN = flags.DEFINE_integer('train_answers', 256, 'Training answers, one per question.')
_HELD_OUT = flags.DEFINE_integer('held_out_answers', 64, 'Held-out answers.')
_ANSWER_TOKENS = flags.DEFINE_integer('answer_tokens', 256, 'Tokens per answer at most.')
_STEPS = flags.DEFINE_integer('steps', 200, 'Optimizer steps per variant.')
_BATCH = flags.DEFINE_integer('batch_size', 16, 'Answers per step.')
_LEARNING_RATE = flags.DEFINE_float('learning_rate', 2e-3, 'AdamW learning rate.')
_FEATURE_WEIGHTS = flags.DEFINE_list('feature_weights', ['0', '1'],
                                     'DrafterTraining.feature_weight of each variant.')
_ABLATION_SEED = flags.DEFINE_integer('ablation_seed', 0, 'Seed of the answers, init, batches.')
_OUT = flags.DEFINE_string('ablation_out_dir', 'results/drafts_w3/feature_loss',
                           'Where results go.')
# W3's drafter block (configs/bench_w3.py drafter).
DRAFTER = DrafterConfig(depth=4, hidden_multiplier=2.0, draft_vocab_size=8192)
TREE_NODES = (4, 16)


def judged(policy, params, held) -> dict:
  top1, mass = agreement_rates(DRAFTER, policy.config, params, policy.params, held)
  rows = held.tokens.shape[0]
  halves = [drafter_answer_paths(DRAFTER, params, policy,
                                 jax.tree.map(lambda x, k=k: x[k * rows // 2:(k + 1) * rows // 2],
                                              held))
            for k in (0, 1)]
  distance = np.asarray(feature_distances(DRAFTER, policy.config, params, policy.params, held))
  return {'top1_by_depth': top1.round(4).tolist(), 'mass_by_depth': mass.round(4).tolist(),
          'feature_distance_by_depth': distance.round(4).tolist(),
          'tau': {str(n): {'best_spine': round(held_out_tau(halves, n, is_spine), 4),
                           'best_tree': round(held_out_tau(halves, n), 4)} for n in TREE_NODES}}


def main(argv):
  del argv
  policy = load_policy(_CHECKPOINT.value)
  count = _TRAIN.value + _HELD_OUT.value
  tasks = load_tasks('gsm8k', count=count, seed=0, data_dir=_DATA_DIR.value, split='train',
                     chat=True)[:count]
  prompts = [policy.prompt_ids(t.prompt, True) for t in tasks]
  plan = WarmStart(num_sequences=_TRAIN.value, held_out=_HELD_OUT.value,
                   max_new_tokens=_ANSWER_TOKENS.value, temperature=1.0,
                   seed=_ABLATION_SEED.value)
  train, held = generated_pairs(policy, prompts, plan, DrafterTraining().target_top_k)
  variants = {}
  for weight in map(float, _FEATURE_WEIGHTS.value):
    training = DrafterTraining(learning_rate=_LEARNING_RATE.value, batch_size=_BATCH.value,
                               steps=_STEPS.value, feature_weight=weight)
    start = time.perf_counter()
    params, loss = train_drafter(policy, DRAFTER, training, train, _ABLATION_SEED.value)
    variants[str(weight)] = {'final_loss': float(loss),
                             'train_seconds': round(time.perf_counter() - start, 1),
                             **judged(policy, params, held)}
    print(f'feature_weight {weight}: {json.dumps(variants[str(weight)])}', file=sys.stderr)
  result = {'checkpoint': _CHECKPOINT.value, 'drafter': dataclasses.asdict(DRAFTER),
            'questions': f'gsm8k:train[0:{count}]', 'train_positions': int(np.sum(train.valid)),
            'held_out_positions': int(np.sum(held.valid)), 'steps': _STEPS.value,
            'batch_size': _BATCH.value, 'variants': variants}
  spine_tree = lambda t: f"{t['best_spine']:.2f} / {t['best_tree']:.2f}"
  rows = [[w, ' / '.join(f'{x:.3f}' for x in v['top1_by_depth']),
           ' / '.join(f'{x:.3f}' for x in v['mass_by_depth'])]
          + [spine_tree(v['tau'][str(n)]) for n in TREE_NODES] + [f"{v['train_seconds']:.0f}"]
          for w, v in variants.items()]
  write(Result(
      'Drafter training variants (held-out, teacher-forced)',
      command_line('experiments.measure.drafter_training_ablation'), result,
      body=[f'{_TRAIN.value} training and {_HELD_OUT.value} held-out T=1 answers of '
            f'{_CHECKPOINT.value} to {result["questions"]}, {_STEPS.value} steps of '
            f'{_BATCH.value}; tau of the best static spine / tree used whole (chosen on one half '
            'of the held-out answers, measured on the other).',
            Table(['feature weight', 'top-1 by depth', 'policy mass on top-1 by depth']
                  + [f'tau {n} nodes spine / tree' for n in TREE_NODES] + ['train s'], rows,
                  align='l' * (4 + len(TREE_NODES)))],
      figures=[Figure('top1.png', 'top-1', lambda fig: plot_top1(fig, variants), size=(6, 4))]),
      _OUT.value)


def plot_top1(fig, variants) -> None:
  ax = fig.subplots()
  for w, v in variants.items():
    ax.plot(range(1, DRAFTER.depth + 1), v['top1_by_depth'], marker='o',
            label=f'feature weight {w}')
  ax.set(xlabel='depth', ylabel='held-out top-1 agreement')
  ax.legend()


if __name__ == '__main__':
  app.run(main)
