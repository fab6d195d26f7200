"""Identity per dtype: how often engines agree when the policy is bfloat16.

  python -m experiments.measure.bf16 --out_dir=results/bf16

On stories260K (16 story openings, W2's 6-token kind, x 4 samples, 160 new tokens, EOS off),
for float32, bfloat16 with float32 decisions (`ModelConfig.float32_decisions`, the default: bf16
parameters, matmul inputs and KV cache; residual stream, accumulation, norms, attention and
logits in float32) and pure bfloat16 (every activation bf16), greedy and T=1:
- the vanilla engine against itself with only the largest batch bucket changed (8 vs 64);
- SpecRoll against vanilla, with every step a tree (fixed capacity, gate off): the oracle
  proposer (the vanilla rollout's true future, so most tokens are decided inside a tree's
  block) and fresh heads;
- the vanilla decode step's time at 64 rows (the cost of float32 decisions on this CPU).
"""
import dataclasses
import time

import jax
import numpy as np
from absl import app, flags

from experiments.lib.workloads import oracle_engine_params, story_openings
from specroll_jax import load_policy
from specroll_jax.model.policy import Policy
from specroll_jax.rollout.driver import Driver, RolloutConfig
from specroll_jax.rollout.sampling import SamplerConfig
from specroll_jax.speculative.factory import build_engine
from specroll_jax.speculative.head_proposer import HeadDraftConfig, HeadProposer
from specroll_jax.speculative.heads import HeadsConfig, init_heads
from specroll_jax.speculative.oracle_proposer import OracleProposer
from specroll_jax.speculative.tree import TreeConfig
from specroll_jax.tasks.paths import STORIES260K_DIR
from experiments.lib.results import Result, Table, command_line, write

_OUT = flags.DEFINE_string('out_dir', 'results/bf16', 'Where results go.')
_PROMPTS = flags.DEFINE_integer('prompts', 16, 'Story openings.')
_SAMPLES = flags.DEFINE_integer('samples', 4, 'Samples per prompt.')
_TOKENS = flags.DEFINE_integer('max_new_tokens', 160, 'Tokens per response.')

MODES = {'float32': ('float32', True), 'bfloat16_float32_decisions': ('bfloat16', True),
         'bfloat16_pure': ('bfloat16', False)}
SAMPLERS = {'greedy': SamplerConfig(temperature=0.0), 'T=1': SamplerConfig(temperature=1.0)}
HEADS = HeadsConfig(num_heads=4)


def policy_in(mode: str) -> Policy:
  dtype, float32_decisions = MODES[mode]
  policy = load_policy(STORIES260K_DIR, dtype=dtype)
  return dataclasses.replace(policy, config=dataclasses.replace(
      policy.config, float32_decisions=float32_decisions))


def identical(a, b) -> int:
  return sum(list(x.token_ids) == list(y.token_ids) for x, y in zip(a, b))


def decode_step_seconds(policy: Policy, prompts, steps: int = 64) -> float:
  """The vanilla step's time at 64 rows: one on-device loop of `steps` steps."""
  rows = [prompts[i % len(prompts)] for i in range(64)]
  driver = Driver(build_engine(policy, 'vanilla', SamplerConfig(1.0), eos_ids=()),
                  RolloutConfig(steps, max_batch=64))
  driver.generate(policy.params, rows, 1, 0)
  times = []
  for seed in range(3):
    start = time.perf_counter()
    driver.generate(policy.params, rows, 1, seed)
    times.append(time.perf_counter() - start)
  return float(np.median(times)) / steps


def measure(mode: str, prompts) -> dict:
  policy = policy_in(mode)
  result = {}
  for name, sampler in SAMPLERS.items():
    run = lambda engine, max_batch, params: Driver(
        engine, RolloutConfig(_TOKENS.value, max_batch=max_batch)).generate(
            params, prompts, _SAMPLES.value, 0)
    vanilla = build_engine(policy, 'vanilla', sampler, eos_ids=())
    wide, narrow = run(vanilla, 64, policy.params), run(vanilla, 8, policy.params)
    heads = init_heads(HEADS, policy.config, seed=1)
    tree = TreeConfig(max_nodes=16, capacity_tokens=512)
    base = HeadProposer(policy.config, HEADS, HeadDraftConfig((4, 2, 2, 2)), sampler)
    oracle = build_engine(policy, 'specroll', sampler,
                          proposer=OracleProposer(base.depth, base=base), tree=tree, eos_ids=())
    with_oracle = run(oracle, 64, oracle_engine_params(oracle, policy, wide, _TOKENS.value,
                                                       heads))
    with_heads_engine = build_engine(policy, 'specroll', sampler, proposer=base, tree=tree,
                                     eos_ids=())
    with_heads = run(with_heads_engine, 64, with_heads_engine.params(policy.params, heads))
    tau = lambda rs: sum(len(r.token_ids) for r in rs) / sum(r.steps for r in rs)
    result[name] = {'vanilla_bucket_8_vs_64': identical(narrow, wide),
                    'oracle_vs_vanilla': identical(with_oracle, wide),
                    'heads_vs_vanilla': identical(with_heads, wide),
                    'oracle_tau': tau(with_oracle), 'heads_tau': tau(with_heads),
                    'responses': len(wide)}
    jax.clear_caches()
  result['decode_step_ms_64_rows'] = 1e3 * decode_step_seconds(policy, prompts)
  jax.clear_caches()
  return result


def main(argv):
  del argv
  # W2's kind of prompt: the first 6 tokens of stories the float32 policy writes from BOS.
  prompts = story_openings(load_policy(STORIES260K_DIR), _PROMPTS.value, 6, 1234)
  results = {'prompts': len(prompts), 'samples': _SAMPLES.value,
             'max_new_tokens': _TOKENS.value,
             'modes': {mode: measure(mode, prompts) for mode in MODES}}
  rows = []
  for mode, r in results['modes'].items():
    for name in SAMPLERS:
      s = r[name]
      rows.append([mode, name, f"{s['vanilla_bucket_8_vs_64']}/{s['responses']}",
                   f"{s['oracle_vs_vanilla']}/{s['responses']}",
                   f"{s['heads_vs_vanilla']}/{s['responses']}", f"{s['oracle_tau']:.2f}",
                   f"{r['decode_step_ms_64_rows']:.2f} ms"])
  write(Result(
      'Identity per dtype (stories260K)', command_line('experiments.measure.bf16'), results,
      body=[f'{len(prompts)} prompts x {_SAMPLES.value} samples, {_TOKENS.value} new tokens, '
            "EOS off; identical responses out of each run's total.",
            Table(['mode', 'sampler', 'vanilla 8 vs 64', 'oracle vs vanilla', 'heads vs vanilla',
                   'oracle tau', 'decode step (64 rows)'], rows, align='llrrrrr')]), _OUT.value)


if __name__ == '__main__':
  app.run(main)
