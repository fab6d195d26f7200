"""A policy's starting reward on candidate GRPO tasks, under every reward rule.

  python -m experiments.measure.reward_survey --policy=workdir/models/smollm2-135m-instruct \
      --out_dir=results/reward_survey

GRPO learns only from groups whose samples earn different rewards. For each candidate task
(`--tasks`: source[:split], prompts as chat turns with `--chat_template`) this samples
`--prompts` prompts x `--group_size` responses at T=1 with the vanilla engine (the tokens
SpecRoll emits), then scores the same responses under each rule of tasks.rewards
(strict, lenient, lenient_format, format) and reports the mean reward, the accuracy (reward
1.0) and the share of groups whose rewards are all equal (no gradient signal). A task and
rule with a mean near 0.2-0.6 and few all-equal groups is one GRPO can move.
"""
import json
import sys
import time

import numpy as np
from absl import app, flags

from specroll_jax import load_policy
from specroll_jax.rl.rollouts import run_prompt_width
from specroll_jax.rl.scoring import scored
from specroll_jax.rollout.driver import Driver, RolloutConfig
from specroll_jax.rollout.sampling import SamplerConfig
from specroll_jax.speculative.factory import build_engine
from specroll_jax.tasks.rewards import REWARD_RULES
from specroll_jax.tasks.sources import load_tasks
from experiments.lib.results import Result, Table, command_line, write

_POLICY = flags.DEFINE_string('policy', 'workdir/models/smollm2-135m-instruct',
                              'An HF policy directory.')
_TASKS = flags.DEFINE_list('tasks', ['gsm8k:train', 'synthetic:easy', 'synthetic:hard'],
                           'Candidate task sources, each source[:split].')
_PROMPTS = flags.DEFINE_integer('prompts', 16, 'Prompts per task.')
_GROUP = flags.DEFINE_integer('group_size', 4, 'Samples per prompt (T=1).')
_MAX_NEW = flags.DEFINE_integer('max_new_tokens', 256, 'Tokens per response at most.')
_CHAT = flags.DEFINE_bool('chat_template', True, 'Prompts as user turns (instruct models).')
_DATA = flags.DEFINE_string('data_dir', None, 'Data directory (default ../shared/data).')
_SEED = flags.DEFINE_integer('seed', 0, 'Task draw and sampling seed.')
_OUT = flags.DEFINE_string('out_dir', 'results/reward_survey', 'Where results go.')


def survey(policy, source: str, split: str | None) -> dict:
  tasks = load_tasks(source, count=_PROMPTS.value, seed=_SEED.value, data_dir=_DATA.value,
                     split=split, chat=_CHAT.value)[:_PROMPTS.value]
  prompts = [policy.prompt_ids(t.prompt, _CHAT.value) for t in tasks]
  engine = build_engine(policy, 'vanilla', SamplerConfig(temperature=1.0))
  driver = Driver(engine, RolloutConfig(_MAX_NEW.value, max_batch=len(prompts) * _GROUP.value,
                                        prompt_bucket_min=run_prompt_width(prompts)))
  start = time.perf_counter()
  responses = driver.generate(engine.params(policy.params), prompts, _GROUP.value, _SEED.value)
  seconds = time.perf_counter() - start
  lengths = [len(r.token_ids) for r in responses]
  rules = {}
  for rule in REWARD_RULES:
    scores = scored(rule, tasks, responses, policy.tokenizer).reshape(len(tasks), _GROUP.value)
    rules[rule] = {'mean_reward': float(scores.mean()), 'accuracy': float((scores == 1.0).mean()),
                   'all_equal_groups': float(np.mean([len(set(g)) == 1 for g in scores]))}
  return {'prompts': len(tasks), 'group_size': _GROUP.value, 'seconds': seconds,
          'mean_length': float(np.mean(lengths)),
          'length_percentiles': {str(q): float(np.percentile(lengths, q)) for q in (10, 50, 90)},
          'capped_share': float(np.mean([n >= _MAX_NEW.value for n in lengths])),
          'rules': rules,
          'example': policy.tokenizer.decode(responses[0].token_ids, skip_special_tokens=True)}


def main(argv):
  del argv
  policy = load_policy(_POLICY.value)
  results = {}
  for task in _TASKS.value:
    source, _, split = task.partition(':') if not task.startswith('synthetic:') else (task, '', '')
    results[task] = survey(policy, source, split or None)
    print(task, json.dumps(results[task]['rules']), file=sys.stderr)
  rows = [[task, rule, f"{v['mean_reward']:.3f}", f"{v['accuracy']:.3f}",
           f"{v['all_equal_groups']:.2f}", f"{r['mean_length']:.0f}",
           ' / '.join(f'{n:.0f}' for n in r['length_percentiles'].values()),
           f"{r['capped_share']:.0%}"]
          for task, r in results.items() for rule, v in r['rules'].items()]
  write(Result(
      'Starting reward per task and rule', command_line('experiments.measure.reward_survey'),
      {'tasks': results},
      body=[f'{_PROMPTS.value} prompts x {_GROUP.value} samples at T=1, <= {_MAX_NEW.value} '
            'tokens, vanilla engine.',
            Table(['task', 'rule', 'mean reward', 'accuracy', 'all-equal groups', 'mean length',
                   'length p10 / p50 / p90', 'capped'], rows, align='llrrrrrr')]), _OUT.value)


if __name__ == '__main__':
  app.run(main)
