"""The GRPO rollout's drafting variants against vanilla, on one batch of a training config.

  python -m experiments.bench.rollout_variants --config=configs/tiny_math.py \
      --heads_dir=workdir/tiny_math/heads --out_dir=results/rollout_variants

Where the main job's audited 0.75x comes from: the trainer's own `Rollouts` (engine, gate,
driver at the run's prompt width) are built for vanilla and for each drafting variant
(heads alone, heads + Reflex, heads + group drafts, heads + group drafts + Reflex: the
default; and the engine held to one node per row without its gate), on the config's first
batch of prompts with the trained policy it starts from and the heads in --heads_dir (a
run's warm start). Each variant's gate is priced once on that batch; then every variant is
timed --repeats times, in alternation, in this process, and the ratio of medians to vanilla
is reported with tau and the share of tree steps.
"""
import statistics
import tempfile
import time
from pathlib import Path

from absl import app, flags
from ml_collections import config_flags

from specroll_jax.model.policy import load_policy
from specroll_jax.rl.adaptation import ProposerState, WarmStarted
from specroll_jax.rl.rollouts import Rollouts, make_proposer, run_prompt_width
from specroll_jax.rl.run import resolve_policy
from specroll_jax.rl.run_config import run_config
from specroll_jax.speculative.heads import load_heads
from specroll_jax.tasks.sources import load_tasks
from experiments.lib.results import Result, Table, command_line, write

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/tiny_math.py')
_HEADS = flags.DEFINE_string('heads_dir', 'workdir/tiny_math/heads', 'Warm-started heads.')
_OUT = flags.DEFINE_string('out_dir', 'results/rollout_variants', 'Where results go.')
_REPEATS = flags.DEFINE_integer('repeats', 5, 'Timed runs per variant.')

# name: (rollout.engine, rollout.proposers, adaptation.mode, rollout overrides). The
# one-node variant is the speculative engine with a budget of one node per row and no gate:
# it runs the vanilla step inside the speculative engine's driver and loop.
VARIANTS = {'vanilla': ('vanilla', 'heads', 'static', {}),
            'one node, no gate': ('specroll', 'heads', 'static',
                                  {'speculation_gate': False, 'tree': {'capacity_tokens': 1}}),
            'heads': ('specroll', 'heads', 'static', {}),
            'heads+reflex': ('specroll', 'heads', 'reflex', {}),
            'heads+group': ('specroll', 'heads,group', 'static', {}),
            'heads+group+reflex': ('specroll', 'heads,group', 'both', {})}


def main(argv):
  del argv
  base = _CONFIG.value
  policy = load_policy(resolve_policy(run_config(base).policy), dtype=base.policy.dtype)
  tasks = load_tasks(base.task.source, count=base.task.count, seed=base.seed)
  task_prompts = [policy.prompt_ids(t.prompt, base.task.chat_template) for t in tasks]
  prompts = task_prompts[:base.rollout.prompts_per_step]
  heads_config, head_params = load_heads(_HEADS.value, policy.config)
  # The heads as a run holds them; the slow path's optimizer and monitor play no part here.
  heads = ProposerState(params=head_params, opt_state=None, monitor=None)
  runs = {}
  with tempfile.TemporaryDirectory() as prices:
    for name, (engine, proposers, mode, overrides) in VARIANTS.items():
      c = base.copy_and_resolve_references()
      c.rollout.engine, c.rollout.proposers, c.adaptation.mode = engine, proposers, mode
      c.rollout.update(overrides)
      config = run_config(c)
      warm = WarmStarted(heads_config, head_params, Path(_HEADS.value))
      rollouts = Rollouts(policy, config.rollout, make_proposer(policy, config, warm),
                          run_prompt_width(task_prompts), None, Path(prices) / f'{len(runs)}.json',
                          first_batch=(policy.params, heads, prompts))  # priced here
      rollouts.generate(policy.params, heads, prompts, base.seed)  # compiles
      runs[name] = rollouts
  times = {name: [] for name in runs}
  summaries = {}
  for _ in range(_REPEATS.value):
    for name, rollouts in runs.items():
      start = time.perf_counter()
      responses = rollouts.generate(policy.params, heads, prompts, base.seed)
      times[name].append(time.perf_counter() - start)
      summaries[name] = rollouts.engine.summarize(responses)
  write(report(runs, times, summaries, len(prompts) * base.rollout.group_size), _OUT.value)


def report(runs, times, summaries, responses) -> Result:
  vanilla = statistics.median(times['vanilla'])
  variants = {name: {'median_s': statistics.median(t), 'times_s': t,
                     'speedup': vanilla / statistics.median(t),
                     'tau': summaries[name]['tau'],
                     'tree_step_share': summaries[name].get('tree_step_share'),
                     'tokens': summaries[name]['tokens'],
                     'tree_step_costs': getattr(runs[name].engine, 'tree_step_costs', None)}
              for name, t in times.items()}
  share = lambda v: '-' if v['tree_step_share'] is None else f"{v['tree_step_share']:.1%}"
  rows = [[name, f"{v['median_s']:.3f}", f"{v['speedup']:.2f}x", f"{v['tau']:.3f}", share(v)]
          for name, v in variants.items()]
  return Result(
      title='GRPO rollout variants against vanilla',
      command=command_line('experiments.bench.rollout_variants'),
      data={'responses': responses, 'variants': variants},
      body=[f'{responses} responses, medians of {_REPEATS.value} alternating runs.',
            Table(['variant', 'median s', 'speedup', 'tau', 'tree steps'], rows, align='lrrrr')])


if __name__ == '__main__':
  app.run(main)
