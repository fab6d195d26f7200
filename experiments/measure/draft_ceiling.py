"""How often any drafter's top-k can hold the policy's T=1 draw: the ceiling under tau.

  python -m experiments.measure.draft_ceiling --out_dir=results/drafts_w3/ceiling

At T=1 the walk accepts a drafted child when the policy's draw equals it, so a drafter whose
top-1 guess for x_{t+1} is the best possible one (the policy's own argmax, knowing the whole
prefix) still agrees with the draw only with probability max_y p(y | x<=t). Averaged over the
positions of the policy's own answers, E[max p] bounds the held-out top-1 agreement of every
one-step proposer (the drafter's depth 1), and of every horizon head too: head k guesses
x_{t+k+1} from x<=t, and max_y E_x'[p(y | x<=t, x')] <= E_x'[max_y p(y | x<=t, x')] (Jensen),
so head k's agreement is at most the same average one position later. The top-k mass bounds
the chance that a k-way set of children holds the draw. The empirical rate at which the
draw equals the argmax is printed beside E[max p]: the two estimate the same number.

The ceiling on tau itself, for a static tree of N nodes per row: a drafter that knew the
policy's law at every depth of every drafted path (the policy drafting for itself, at no
cost) is a set of rank paths (experiments.lib.rank_trees), and the ranks of the policy's own T=1
answers under its laws are Monte Carlo draws of its walk. The best N-node tree is chosen on
one half of the answers and its tau (1 + accepted depth) measured on the other, both ways.

The ceiling for trees shaped per position (`--dynamic_answers` of the answers): the same
drafter growing, at each position, its best N-node tree by best-first expansion under the
policy's law (experiments.lib.best_first), whose tau is 1 + the sum of its paths'
probabilities: no static shape can do better, and no drafter that proposes from the same
prefix can beat it in expectation.
"""
import sys
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from tqdm import tqdm

from experiments.lib.best_first import popped_probabilities
from experiments.lib.rank_trees import RANKS, best_tree, rank_paths, tree_tau, two_fold_tau
from specroll_jax import load_policy
from specroll_jax.model.transformer import padded_sequence_hidden
from specroll_jax.model.vocab_chunks import map_projected
from specroll_jax.rl.grpo import batch_from_rollouts
from specroll_jax.rl.rollouts import run_prompt_width
from specroll_jax.rollout.driver import Driver, RolloutConfig
from specroll_jax.rollout.sampling import SamplerConfig
from specroll_jax.speculative.factory import build_engine
from specroll_jax.tasks.sources import load_tasks
from experiments.lib.results import Result, Table, command_line, write

_POLICY = flags.DEFINE_string('policy', 'workdir/models/smollm2-135m-instruct',
                              'An HF policy directory.')
_SOURCE = flags.DEFINE_string('source', 'gsm8k', 'Task source of the prompts.')
_SPLIT = flags.DEFINE_string('split', 'test', 'Its split (held out from every training set).')
_PROMPTS = flags.DEFINE_integer('prompts', 32, 'Prompts, one T=1 answer each.')
_MAX_NEW = flags.DEFINE_integer('max_new_tokens', 256, 'Tokens per answer at most.')
_DATA = flags.DEFINE_string('data_dir', None, 'Data directory (default ../shared/data).')
_SEED = flags.DEFINE_integer('seed', 0, 'Task draw and sampling seed.')
_OUT = flags.DEFINE_string('out_dir', 'results/drafts_w3/ceiling', 'Where results go.')
_DYNAMIC = flags.DEFINE_integer('dynamic_answers', 32,
                                'Answers whose positions get best-first trees (0: none).')
ROWS_PER_FORWARD = 8
BUDGETS = (4, 8, 16)   # nodes per row, root included (experiments.bench.drafts' budgets)
DEPTHS = (4, 15)       # the heads' and drafter's depth; and as deep as 16 nodes allow


@partial(jax.jit, static_argnums=0)
def next_token_laws(model_config, params, tokens):
  """Per position of right-padded rows: the policy's top-RANKS probabilities for the next
  token, and the realised next token's rank in that law (RANKS: below the top RANKS)."""
  hidden, safe, _ = padded_sequence_hidden(model_config, params, tokens)
  batch, width, dim = hidden.shape
  following = jnp.pad(safe[:, 1:], ((0, 0), (0, 1))).reshape(-1)

  def law(logits, realised):
    probs, ids = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), RANKS)
    hits = ids == realised[:, None]
    return probs, jnp.where(hits.any(-1), jnp.argmax(hits, -1), RANKS)

  probs, ranks = map_projected(model_config, params, hidden.reshape(-1, dim), law, following)
  return probs.reshape(batch, width, RANKS), ranks.reshape(batch, width)


def main(argv):
  del argv
  policy = load_policy(_POLICY.value)
  tasks = load_tasks(_SOURCE.value, count=_PROMPTS.value, seed=_SEED.value,
                     data_dir=_DATA.value, split=_SPLIT.value, chat=True)[:_PROMPTS.value]
  prompts = [policy.prompt_ids(t.prompt, True) for t in tasks]
  engine = build_engine(policy, 'vanilla', SamplerConfig(temperature=1.0))
  driver = Driver(engine, RolloutConfig(_MAX_NEW.value, max_batch=len(prompts),
                                        prompt_bucket_min=run_prompt_width(prompts)))
  responses = driver.generate(engine.params(policy.params), prompts, 1, _SEED.value)
  batch = batch_from_rollouts([prompts[r.prompt_index] for r in responses],
                              [r.token_ids for r in responses], [r.logprobs for r in responses],
                              np.zeros(len(responses)), max(map(len, prompts)) + _MAX_NEW.value)
  rows = np.asarray(batch.tokens)
  # Positions whose next token is a response token: the last prompt position onwards.
  span = np.pad(np.asarray(batch.response_mask)[:, 1:], ((0, 0), (0, 1)))
  masses, ranks_by_answer = [], []
  for start in range(0, len(rows), ROWS_PER_FORWARD):
    probs, ranks = next_token_laws(policy.config, policy.params,
                                   jnp.asarray(rows[start:start + ROWS_PER_FORWARD]))
    inside = span[start:start + ROWS_PER_FORWARD]
    masses.append(np.asarray(probs)[inside])
    ranks_by_answer += [np.asarray(r)[m] for r, m in zip(ranks, inside)]
  masses = np.concatenate(masses)
  drawn = np.concatenate(ranks_by_answer)
  top_k_mass = np.cumsum(masses, axis=-1).mean(axis=0)
  result = {
      'policy': _POLICY.value, 'prompts': f'{_SOURCE.value}:{_SPLIT.value}',
      'answers': len(responses), 'positions': int(len(masses)),
      'expected_max_prob': float(top_k_mass[0]),
      'argmax_drawn_rate': float(np.mean(drawn == 0)),
      'top_k_mass': {str(k + 1): float(m) for k, m in enumerate(top_k_mass)},
      'max_prob_quantiles': {str(q): float(np.quantile(masses[:, 0], q))
                             for q in (0.1, 0.25, 0.5, 0.75, 0.9)},
      'tau_ceiling': {f'{nodes}_nodes_depth_{depth}': two_fold_tau(ranks_by_answer, nodes, depth)
                      for nodes in BUDGETS for depth in DEPTHS},
  }
  if _DYNAMIC.value:
    result.update(dynamic_ceiling(policy, rows[:_DYNAMIC.value], span[:_DYNAMIC.value]))
    result['static_tau_on_dynamic_answers'] = static_on(ranks_by_answer, _DYNAMIC.value)
  write(Result(
      'Draft ceilings: static and per-position trees of a drafter that knows the policy\'s law',
      command_line('experiments.measure.draft_ceiling'), result,
      body=[f"{result['positions']} positions of {result['answers']} answers to "
            f"{result['prompts']}; the best tree of each size chosen on one half of the answers, "
            'measured on the other.',
            Table(['nodes, depth', 'tau'], [[key.replace('_nodes_depth_', ', '), f'{tau:.3f}']
                                            for key, tau in result['tau_ceiling'].items()],
                  align='lr'),
            *dynamic_lines(result)]), _OUT.value)


def dynamic_ceiling(policy, rows, span) -> dict:
  """Best-first trees of up to max(BUDGETS) nodes at every response position of `rows`:
  mean tau per budget, and per position its spread."""
  popped = []
  for row, inside in tqdm(list(zip(rows, span)), desc='best-first trees', file=sys.stderr):
    answer = row[row >= 0]
    popped.append(popped_probabilities(policy, answer, np.nonzero(inside[:len(answer)])[0],
                                       max(BUDGETS), policy.eos_ids))
  taus = 1.0 + np.cumsum(np.concatenate(popped), axis=1)             # [positions, N - 1]
  return {'dynamic_positions': int(len(taus)), 'dynamic_answers': len(rows),
          'dynamic_tau_ceiling': {str(n): float(taus[:, n - 2].mean()) for n in BUDGETS},
          'dynamic_tau_quantiles': {str(n): {str(q): float(np.quantile(taus[:, n - 2], q))
                                             for q in (0.1, 0.5, 0.9)} for n in BUDGETS}}


def static_on(ranks_by_answer, count: int) -> dict:
  """The best static tree chosen on the other answers and measured on the first `count`: the
  static ceiling on the positions the per-position one was measured on."""
  depth = max(DEPTHS)
  chosen = [p for a in ranks_by_answer[count:] for p in rank_paths(a, depth)]
  measured = [p for a in ranks_by_answer[:count] for p in rank_paths(a, depth)]
  return {str(n): tree_tau(best_tree(chosen, n), measured) for n in BUDGETS}


def dynamic_lines(result) -> list:
  if 'dynamic_tau_ceiling' not in result:
    return []
  return [f"Trees shaped per position (best-first under the policy's law, no depth limit), "
          f"{result['dynamic_positions']} positions of {result['dynamic_answers']} answers:",
          Table(['nodes', 'tau', 'static tree on the same positions',
                 'tau at the 10% / 50% / 90% of positions'],
                [[n, f'{tau:.3f}', f"{result['static_tau_on_dynamic_answers'][n]:.3f}",
                  ' / '.join(f'{v:.2f}' for v in result['dynamic_tau_quantiles'][n].values())]
                 for n, tau in result['dynamic_tau_ceiling'].items()], align='rrrl')]


if __name__ == '__main__':
  app.run(main)
