"""bf16 compute against float32 on SmolLM2 (W3's model), in one process, the modes alternating.

  python -m experiments.measure.bf16_compute --out_dir=results/bf16_compute

Measures, for ModelConfig.compute_dtype 'float32' and 'bfloat16' (float32 parameters; the
bf16 engines round them once per rollout):
  - the vanilla decode step (ms, from the driver's first state on GSM8K chat prompts) at
    1 / 4 / 16 / 64 rows, STEPS_PER_CALL steps per timed call as the gate prices them;
  - the tree-step price, in plain steps of the same mode, at buckets 1 / 4 / 16 for 4, 8
    and 16 nodes per row, drafted by the sequential drafter's spine (random block weights:
    a step's cost does not depend on them);
  - bit-for-bit checks on SmolLM2 (T = 1): a row decoded in a batch of 4 and alone, the
    oracle's trees against vanilla, the rollout against the learner's recomputed log-probs;
  - transformers `generate` in bf16 against our vanilla in bf16, whole rollouts.
Writes results.json and README.md. Keep the CPU otherwise idle (about 30 minutes).
"""
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from experiments.lib.common import left_padded
from specroll_jax.model.policy import load_policy
from specroll_jax.rl import grpo
from specroll_jax.rollout.driver import Driver, RolloutConfig, take_rows
from specroll_jax.rollout.sampling import SamplerConfig
from specroll_jax.speculative.drafter import DrafterConfig, init_drafter
from specroll_jax.speculative.drafter_proposer import DrafterProposer, spine_paths
from specroll_jax.speculative.factory import build_engine
from specroll_jax.speculative.oracle_proposer import OracleParams, OracleProposer
from specroll_jax.speculative.step_cost import STEPS_PER_CALL, compiled_steps, measure_step_costs
from specroll_jax.speculative.tree import TreeConfig
from specroll_jax.tasks.sources import load_tasks
from experiments.lib.results import Figure, Result, Table, write

flags.DEFINE_string('checkpoint', 'workdir/models/smollm2-135m-instruct', 'SmolLM2 HF directory.')
flags.DEFINE_string('data_dir', None, 'Dataset directory (default: the shared data).')
flags.DEFINE_list('decode_rows', ['1', '4', '16', '64'], 'Rows of the vanilla step.')
flags.DEFINE_list('tree_buckets', ['1', '4', '16'], 'Batch buckets priced.')
flags.DEFINE_list('tree_nodes', ['4', '8', '16'], 'Nodes per row priced.')
flags.DEFINE_list('hf_rows', ['4', '16'], 'Batches of the transformers comparison (empty: skip).')
flags.DEFINE_integer('repeats', 5, 'Alternating timed calls per measurement.')
flags.DEFINE_string('out_dir', 'results/bf16_compute', 'Where results.json and README.md go.')
flags.DEFINE_bool('report_only', False, 'Rewrite README.md and the plot from results.json.')
FLAGS = flags.FLAGS

MODES = ('float32', 'bfloat16')
SAMPLER = SamplerConfig(temperature=1.0)
NEW_TOKENS = 64
DRAFTER_SPINE = (8, 4, 4, 2)  # configs/bench_w3.py's drafter_branching


def _prompts(policy, count):
  tasks = load_tasks('gsm8k', count=count, seed=0, data_dir=FLAGS.data_dir, split='test',
                     chat=True)[:count]
  return [policy.prompt_ids(t.prompt, True) for t in tasks]


def _first_state(engine, params, prompts, rows):
  driver = Driver(engine, RolloutConfig(max_new_tokens=NEW_TOKENS, max_batch=rows))
  return driver.first_state(params, prompts[:rows], 1)


def decode_step_ms(policies, prompts, rows):
  """{mode: median ms per vanilla step} at `rows` rows, the modes' calls alternating."""
  steps, states = {}, {}
  for mode, policy in policies.items():
    engine = build_engine(policy, 'vanilla', SAMPLER, eos_ids=())
    params = engine.params(policy.params)
    states[mode] = (params, _first_state(engine, params, prompts, rows))
    steps[mode] = compiled_steps(engine.step)
  key, first = jax.random.key(0), jnp.arange(rows, dtype=jnp.int32)
  times = {mode: [] for mode in policies}
  for repeat in range(FLAGS.repeats + 1):
    for mode in policies:
      params, state = states[mode]
      rows_state = jax.block_until_ready(take_rows(state, first))
      start = time.perf_counter()
      jax.block_until_ready(steps[mode](params, rows_state, key))
      if repeat:  # the first call compiles
        times[mode].append((time.perf_counter() - start) / STEPS_PER_CALL * 1e3)
  return {mode: statistics.median(t) for mode, t in times.items()}


def tree_price(policy, prompts, drafter_params, batch, nodes):
  """Tree step / plain step at `batch` rows and `nodes` nodes per row, same mode."""
  config = DrafterConfig()
  engine = build_engine(
      policy, 'specroll', SAMPLER,
      proposer=DrafterProposer(policy.config, config, spine_paths(DRAFTER_SPINE), SAMPLER),
      tree=TreeConfig(capacity_tokens=batch * nodes, max_nodes=16,
                      sized_widths=((batch, nodes),)), eos_ids=())
  params = engine.params(policy.params, drafter_params)
  state = _first_state(engine, params, prompts, batch)
  ((_, cost),) = measure_step_costs(engine, params, state, jax.random.key(0), (batch,),
                                    FLAGS.repeats)
  return cost


def _bitwise(a, b):
  return sum(x.token_ids == y.token_ids and np.array_equal(np.asarray(x.logprobs, np.float32),
                                                           np.asarray(y.logprobs, np.float32))
             for x, y in zip(a, b))


def identity_checks(policy, prompts):
  """Counts of responses equal bit for bit (tokens and log-probs), of len(prompts)."""
  run = lambda engine, params, rows: Driver(engine, RolloutConfig(
      max_new_tokens=NEW_TOKENS, max_batch=rows)).generate(params, prompts, 1, seed=3)
  vanilla = build_engine(policy, 'vanilla', SAMPLER)
  batched = run(vanilla, vanilla.params(policy.params), len(prompts))
  alone = run(vanilla, vanilla.params(policy.params), 1)
  future = np.zeros((len(batched), NEW_TOKENS), np.int32)
  for i, r in enumerate(batched):
    future[i, :len(r.token_ids)] = r.token_ids
  oracle = build_engine(policy, 'specroll', SAMPLER, proposer=OracleProposer(4),
                        tree=TreeConfig(capacity_tokens=64, max_nodes=16))
  spec = run(oracle, oracle.params(policy.params, OracleParams(None, jnp.asarray(future))),
             len(prompts))
  rows = [list(prompts[r.prompt_index]) + list(r.token_ids) for r in batched]
  tokens = np.full((len(rows), max(map(len, rows))), -1, np.int32)
  for i, row in enumerate(rows):
    tokens[i, :len(row)] = row
  learner = np.asarray(grpo.token_logprobs(policy.config, policy.params, jnp.asarray(tokens),
                                           SAMPLER.temperature))
  same_as_learner = sum(np.array_equal(
      learner[i, len(prompts[r.prompt_index]):len(rows[i])], np.asarray(r.logprobs, np.float32))
      for i, r in enumerate(batched))
  return {'responses': len(prompts), 'batch_vs_alone': _bitwise(batched, alone),
          'spec_vs_vanilla': _bitwise(batched, spec),
          'spec_tokens_equal': sum(x.token_ids == y.token_ids for x, y in zip(batched, spec)),
          'rollout_vs_learner': int(same_as_learner),
          'tau_oracle': sum(len(r.token_ids) for r in spec) / sum(r.steps for r in spec)}


def hf_generate_ratio(policy, prompts, rows):
  """(our bf16 vanilla rollout seconds, transformers bf16 generate seconds), 64 new tokens."""
  import torch  # noqa: PLC0415 (the comparison only)
  import transformers  # noqa: PLC0415
  hf = transformers.AutoModelForCausalLM.from_pretrained(FLAGS.checkpoint, dtype=torch.bfloat16)
  hf.eval()
  batch = left_padded(prompts[:rows], 0)
  engine = build_engine(policy, 'vanilla', SAMPLER, eos_ids=())
  driver = Driver(engine, RolloutConfig(max_new_tokens=NEW_TOKENS, max_batch=rows))
  params = engine.params(policy.params)
  ours = lambda: driver.generate(params, prompts[:rows], 1, seed=0)

  def theirs():
    with torch.no_grad():
      hf.generate(**batch, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                  max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, pad_token_id=0)

  ours(), theirs()
  times = {'ours': [], 'hf': []}
  for _ in range(max(1, FLAGS.repeats // 2)):
    for name, fn in (('ours', ours), ('hf', theirs)):
      start = time.perf_counter()
      fn()
      times[name].append(time.perf_counter() - start)
  return statistics.median(times['ours']), statistics.median(times['hf'])


def report(out) -> Result:
  """The tables and decode_and_tree.png from the results (also from a results.json read
  back, with the notes added to it by hand where a figure could not be measured)."""
  data = {k: v for k, v in out.items() if k != 'command'}
  decode = Table(['rows', 'vanilla step float32 ms', 'bf16 ms', 'bf16 / float32 speed'],
                 [[rows, f'{ms["float32"]:.1f}', f'{ms["bfloat16"]:.1f}',
                   f'{out["vanilla_bf16_over_fp32"][rows]:.2f}x']
                  for rows, ms in out['decode_step_ms'].items()])
  tree = Table(['bucket', 'nodes', 'tree price float32 (plain steps)', 'bf16'],
               [[bucket, nodes, f'{out["tree_price_float32"][bucket][nodes]:.2f}', f'{price:.2f}']
                for bucket, prices in out['tree_price'].items() for nodes, price in prices.items()])
  identity = Table(['mode', 'responses', 'batch of 4 = alone', 'SpecRoll = vanilla',
                    'rollout = learner'],
                   [[mode, c['responses'], c['batch_vs_alone'], c['spec_vs_vanilla'],
                     c['rollout_vs_learner']] for mode, c in out['invariance_checks'].items()],
                   align='lrrrr')
  hf = Table(['rows', 'our vanilla bf16 s', 'transformers generate bf16 s', 'ours / theirs speed'],
             [[rows, f'{t["ours_bf16"]:.2f}', f'{t["hf_bf16"]:.2f}',
               f'{out["vanilla_bf16_over_hf_bf16"][rows]:.2f}x']
              for rows, t in out['hf_seconds'].items()])
  notes = [f'{key}: {out[key]}' for key in ('update_note', 'spec_tail_note') if key in out]
  return Result(
      'bf16 compute against float32 (SmolLM2-135M)', out['command'], data,
      body=[f'{out["minutes"]:.0f} minutes, idle 2-core CPU. notes/history.md, "bf16 compute".',
            decode, tree, identity,
            '(bit for bit: tokens and every log-prob; SpecRoll is the oracle, tau '
            f'{out["invariance_checks"]["bfloat16"]["tau_oracle"]:.2f})', hf, *notes],
      figures=[Figure('decode_and_tree.png', 'decode step and tree price',
                      lambda fig: plot_modes(fig, out))])


def plot_modes(fig, out) -> None:
  left, right = fig.subplots(1, 2)
  rows = list(out['decode_step_ms'])
  for mode in MODES:
    left.plot([int(r) for r in rows], [out['decode_step_ms'][r][mode] for r in rows], 'o-',
              label=mode)
    prices = out['tree_price' if mode == 'bfloat16' else 'tree_price_float32']
    labels = [f'{b}x{n}' for b in prices for n in prices[b]]
    right.plot(labels, [prices[b][n] for b in prices for n in prices[b]], 'o-', label=mode)
  left.set(xscale='log', xlabel='rows', ylabel='vanilla step (ms)')
  right.set(xlabel='bucket x nodes', ylabel='tree step (plain steps)')
  left.legend(), right.legend()


def main(argv):
  del argv
  directory = Path(FLAGS.out_dir)
  if FLAGS.report_only:
    write(report(json.loads((directory / 'results.json').read_text())), directory)
    return
  started = time.time()
  policies = {mode: load_policy(FLAGS.checkpoint, compute_dtype=mode) for mode in MODES}
  prompts = _prompts(policies['float32'], max(map(int, FLAGS.decode_rows)))
  out = {'command': 'python -m experiments.measure.bf16_compute ' + ' '.join(
      f'--{f}={FLAGS[f].serialize().split("=", 1)[1]}' for f in (
          'decode_rows', 'tree_buckets', 'tree_nodes', 'hf_rows', 'repeats')),
         'checkpoint': FLAGS.checkpoint, 'new_tokens': NEW_TOKENS, 'steps_per_call': STEPS_PER_CALL}
  out['decode_step_ms'] = {rows: decode_step_ms(policies, prompts, int(rows))
                           for rows in FLAGS.decode_rows}
  out['vanilla_bf16_over_fp32'] = {rows: ms['float32'] / ms['bfloat16']
                                   for rows, ms in out['decode_step_ms'].items()}
  print(json.dumps(out['decode_step_ms'], indent=1), flush=True)
  drafter_params = init_drafter(DrafterConfig(), policies['float32'].config,
                                np.arange(DrafterConfig().draft_vocab_size, dtype=np.int32))
  prices = {mode: {b: {n: tree_price(policies[mode], prompts, drafter_params, int(b), int(n))
                        for n in FLAGS.tree_nodes} for b in FLAGS.tree_buckets} for mode in MODES}
  out['tree_price'], out['tree_price_float32'] = prices['bfloat16'], prices['float32']
  print(json.dumps(prices, indent=1), flush=True)
  out['invariance_checks'] = {mode: identity_checks(policies[mode], prompts[:4]) for mode in MODES}
  checks = out['invariance_checks']['bfloat16']
  out['invariance'] = {
      'spec_vs_vanilla_bitwise': checks['spec_vs_vanilla'] == checks['responses'],
      'rollout_vs_learner_bitwise': checks['rollout_vs_learner'] == checks['responses']}
  out['spec_identical_fraction'] = checks['spec_tokens_equal'] / checks['responses']
  hf = {rows: hf_generate_ratio(policies['bfloat16'], prompts, int(rows)) for rows in FLAGS.hf_rows}
  out['vanilla_bf16_over_hf_bf16'] = {rows: theirs / ours for rows, (ours, theirs) in hf.items()}
  out['hf_seconds'] = {rows: {'ours_bf16': ours, 'hf_bf16': theirs}
                       for rows, (ours, theirs) in hf.items()}
  out['minutes'] = (time.time() - started) / 60
  write(report(out), directory)


if __name__ == '__main__':
  app.run(main)
