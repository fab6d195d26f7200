"""Where a rollout step's time goes: the engine's on-device loop, traced and grouped by stage.

  python -m experiments.profile.step --config=configs/bench_w3.py --engine=oracle --responses=16

Builds a benchmark config's workload (experiments/lib/workloads.py: its prompts, warm-started
heads, trees and sampler), prefills the first `responses` rows, runs the engine's loop
once to compile it, then traces one more run of the loop with jax.profiler. Each executed
XLA operation is charged to the step stage that emitted it, read from the op_name metadata
of the compiled loop: the named scopes of SpecEngine.step (root_draw, propose, build_tree,
verify_forward, walk, commit, statistics, observe) and VanillaEngine.step (root_draw,
verify_forward, commit, project). What no stage claims is the loop's own bookkeeping.
Prints milliseconds per loop iteration per stage and per model module inside each stage
(q_proj, mlp, the attention windows, ...) and writes them to
<out_dir>/<engine>_<responses>.json.
"""
import collections
import gzip
import json
import re
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from absl import app, flags
from ml_collections import config_flags

from specroll_jax import load_policy
from specroll_jax.rollout.driver import Driver, RolloutConfig
from specroll_jax.rollout.engine import compiled_run
from specroll_jax.rollout.sampling import SamplerConfig
from specroll_jax.speculative.factory import tree_config
from experiments.lib.results import command_line, write_json
from experiments.lib.workloads import (benchmark_prompts, oracle_engine_params, sweep_slice,
                                   warm_started_drafts, workload_engines)

STAGES = ('root_draw', 'propose', 'build_tree', 'verify_forward', 'walk', 'project', 'commit',
          'statistics', 'observe')
LOOP = 'loop'  # the while loop's condition, row constraints and carried-state plumbing

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/bench_w3.py')
flags.DEFINE_enum('engine', 'oracle', ['vanilla', 'specroll', 'oracle'], 'Engine to profile.')
flags.DEFINE_integer('responses', 16, 'Rows in flight (the first rows of the workload).')
flags.DEFINE_string('out_dir', 'results/profile_step', 'Where the JSON goes.')
FLAGS = flags.FLAGS


# Instructions whose trace events enclose the events of the computations they run.
_CONTAINERS = re.compile(r' (conditional|while|call)\(')


def stage_of_instruction(hlo_text: str) -> dict:
  """HLO instruction name -> (step stage, stage/module path) from its op_name metadata:
  the stage is LOOP where no stage scope holds the instruction; layer indices are merged
  ('layers_N'). Containers (conditionals, loops, calls) are left out: their bodies count."""
  stages = {}
  for line in hlo_text.splitlines():
    match = re.match(r'\s*(?:ROOT )?%?([\w.\-]+) = ', line)
    if not match or _CONTAINERS.search(line):
      continue
    op_name = re.search(r'op_name="([^"]+)"', line)
    scopes = op_name.group(1).split('/') if op_name else []
    at = next((i for i, s in enumerate(scopes) if s in STAGES), None)
    if at is None:
      stages[match.group(1)] = (LOOP, LOOP)
    else:
      path = '/'.join(scopes[at:-1]) or scopes[at]
      stages[match.group(1)] = (scopes[at], re.sub(r'(layers|branch)_\d+', r'\1_N', path))
  return stages


def traced_op_times(trace_dir: Path) -> collections.Counter:
  """Total microseconds per executed operation name in the trace under `trace_dir`."""
  [trace_file] = trace_dir.glob('**/*.trace.json.gz')
  events = json.load(gzip.open(trace_file))['traceEvents']
  totals = collections.Counter()
  for event in events:
    if event.get('ph') == 'X':
      totals[event['name']] += event['dur']
  return totals


def profile_loop(engine, params, state, seed_key) -> dict:
  """ms per loop iteration by stage and by module, from one traced run of `engine.run`."""
  stop = jnp.int32(0)
  # One executable for every run, and its HLO is what the trace's operation names refer to.
  run = compiled_run(jax.default_backend()).lower(engine, params, state, seed_key, stop).compile()
  jax.block_until_ready(run(params, state, seed_key, stop))  # warm up
  start = time.perf_counter()
  jax.block_until_ready(run(params, state, seed_key, stop))
  wall = time.perf_counter() - start  # untraced: writing the trace takes seconds
  with tempfile.TemporaryDirectory() as trace_dir:
    jax.profiler.start_trace(trace_dir)
    final = jax.block_until_ready(run(params, state, seed_key, stop))
    jax.profiler.stop_trace()
    op_times = traced_op_times(Path(trace_dir))
  stages = stage_of_instruction(run.as_text())
  iterations = int(jnp.max(final.seqs.steps))
  per_stage, per_module = collections.Counter(), collections.Counter()
  for name, micros in op_times.items():
    if name in stages:
      stage, module = stages[name]
      per_stage[stage] += micros
      per_module[module] += micros
  ms = lambda micros: micros / 1e3 / iterations
  tokens = int(jnp.sum(final.seqs.num_generated))
  return {'iterations': iterations, 'tokens': tokens,
          'tokens_per_row_step': tokens / max(int(jnp.sum(final.seqs.steps)), 1),
          'wall_ms_per_iteration': 1e3 * wall / iterations,
          'traced_ms_per_iteration': ms(sum(per_stage.values())),
          'stages_ms_per_iteration': {s: ms(per_stage[s]) for s in STAGES + (LOOP,)
                                      if per_stage[s]},
          'modules_ms_per_iteration': {m: ms(t) for m, t in per_module.most_common()}}


def main(argv):
  del argv
  c = _CONFIG.value
  policy = load_policy(c.checkpoint, c.dtype)
  drafts = warm_started_drafts(policy, c)
  tree = tree_config(policy, max_nodes=c.max_nodes, capacity_tokens=c.capacity_tokens,
                     per_batch_capacity=c.capacity_per_batch)
  sampler = SamplerConfig(temperature=c.temperature)
  prompts, samples = sweep_slice(benchmark_prompts(policy, c), c.samples_per_prompt,
                                 FLAGS.responses)
  rollout = RolloutConfig(c.max_new_tokens, max_batch=len(prompts) * samples,
                          prompt_buckets_per_octave=c.prompt_buckets_per_octave)
  engines = workload_engines(policy, drafts, c, tree, sampler)
  engine = engines[FLAGS.engine]
  if FLAGS.engine == 'vanilla':
    params = policy.params
  elif FLAGS.engine == 'specroll':
    params = engine.params(policy.params, drafts.params)
  else:
    reference = Driver(engines['vanilla'], rollout).generate(policy.params, prompts, samples,
                                                             c.seed)
    params = oracle_engine_params(engine, policy, reference, c.max_new_tokens)
  state = Driver(engine, rollout).first_state(params, prompts, samples)
  result = profile_loop(engine, params, state, jax.random.key(c.seed))
  result.update(command=command_line('experiments.profile.step'),
                engine=FLAGS.engine, responses=len(prompts) * samples,
                tree_width=engine.tree_width(len(prompts) * samples)
                if FLAGS.engine != 'vanilla' else 1,
                backend=jax.default_backend())
  write_json(Path(FLAGS.out_dir) / f'{FLAGS.engine}_{result["responses"]}.json', result)
  print(f'{FLAGS.engine}, {result["responses"]} responses, {result["iterations"]} iterations, '
        f'{result["tokens"]} tokens ({result["tokens_per_row_step"]:.2f} per row step): '
        f'{result["wall_ms_per_iteration"]:.1f} ms per iteration (traced ops '
        f'{result["traced_ms_per_iteration"]:.1f})')
  for stage, ms in result['stages_ms_per_iteration'].items():
    print(f'  {stage:15s} {ms:8.2f} ms')
  print('modules taking >= 1 ms:')
  for module, ms in result['modules_ms_per_iteration'].items():
    if ms >= 1:
      print(f'  {module:70s} {ms:8.2f} ms')


if __name__ == '__main__':
  app.run(main)
