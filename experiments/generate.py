"""Samples G responses per prompt from an HF checkpoint and writes them as JSONL.

  python -m experiments.generate --checkpoint=specroll_jax/tasks/stories260K \
      --prompts=prompts.jsonl --num_samples=4 --out=samples.jsonl
"""
import dataclasses
import json
import sys
from pathlib import Path

from absl import app, flags
from tqdm import tqdm

from experiments.lib.common import DEFAULT_CHECKPOINT, read_prompts, write_jsonl_atomic
from specroll_jax import load_policy
from specroll_jax.model.attention import ATTENTION_IMPLEMENTATIONS
from specroll_jax.model.mesh import MeshConfig, make_mesh, shard_params
from specroll_jax.rl.learned_proposers import KINDS, saved_kind_name
from specroll_jax.rollout.driver import Driver, RolloutConfig
from specroll_jax.rollout.sampling import SamplerConfig
from specroll_jax.speculative.factory import ENGINES, PricingWorkload, build_engine, tree_config
from specroll_jax.speculative.gate import GateConfig
from specroll_jax.speculative.group_proposer import GroupDraftConfig, GroupProposer

flags.DEFINE_string('checkpoint', str(DEFAULT_CHECKPOINT), 'HF-format policy directory.')
flags.DEFINE_string('prompts', None, 'JSONL file with one {"prompt": "..."} per line.')
flags.DEFINE_bool('chat_template', False,
                  'Each prompt as a user turn through the tokenizer\'s chat template '
                  '(instruct models; base models keep raw prompts).')
flags.DEFINE_integer('num_samples', 1, 'Responses per prompt (G).')
flags.DEFINE_float('temperature', 1.0, 'Sampling temperature; 0 means greedy.')
flags.DEFINE_integer('top_k', 0, 'Keep the k most likely tokens; 0 disables.')
flags.DEFINE_float('top_p', 1.0, 'Nucleus mass; 1.0 disables.')
flags.DEFINE_integer('max_new_tokens', 128, 'Maximum generated tokens per response.')
flags.DEFINE_integer('seed', 0,
                     'Rollout seed (the randomness contract in specroll_jax/rollout/sampling.py).')
flags.DEFINE_enum('engine', 'vanilla', list(ENGINES), 'Rollout engine.')
flags.DEFINE_string('proposer_dir', None,
                    'engine=specroll: a learned proposer saved by experiments.train_heads (or '
                    "a run's warm start): heads or the sequential drafter, told by its files. "
                    'It drafts --branching candidate ranks per depth.')
flags.DEFINE_bool('group_drafts', None,
                  'engine=specroll: also draft continuations found in the prompt and the other '
                  'samples of it (speculative/group_proposer.py). Default: on when '
                  '--num_samples > 1. Without --proposer_dir, the only drafts.')
flags.DEFINE_integer('capacity_tokens', 0,
                     'C_hw for the tree budget; 0 = the cached capacity profile (measured '
                     'on first use, see experiments.profile.capacity), per batch size.')
flags.DEFINE_integer('max_nodes', 64, 'N_max: tree nodes per response, root included.')
flags.DEFINE_enum('tree_attention', 'xla', list(ATTENTION_IMPLEMENTATIONS),
                  'Attention of the verification forward: xla or the Pallas kernel.')
flags.DEFINE_list('branching', ['8', '4', '2', '2'], 'Candidate ranks per tree depth.')
flags.DEFINE_bool('size_trees', False,
                  'With the gate: each batch bucket\'s tree width from the measured price and '
                  'tokens per step of 2, 4, ... nodes (speculative/step_cost.py size_trees).')
flags.DEFINE_bool('speculation_gate', True,
                  'engine=specroll: a plain step wherever a tree is not expected to pay for '
                  'its cost, measured on these prompts before generating (speculative/gate.py).')
flags.DEFINE_integer('max_batch', 64, 'Largest compiled batch bucket.')
flags.DEFINE_integer('mesh_data', 1, 'Devices on the data axis (-1: all).')
flags.DEFINE_integer('mesh_tensor', 1, 'Devices on the tensor axis (weights split Megatron-style).')
flags.DEFINE_enum('dtype', 'float32', ['float32', 'bfloat16'], 'Parameter dtype.')
flags.DEFINE_string('out', None, 'Output JSONL path.')
flags.mark_flags_as_required(['prompts', 'out'])
FLAGS = flags.FLAGS


def main(argv):
  del argv
  policy = load_policy(FLAGS.checkpoint, dtype=FLAGS.dtype)
  texts = read_prompts(Path(FLAGS.prompts))
  prompts = [policy.prompt_ids(t, FLAGS.chat_template) for t in texts]
  mesh = (make_mesh(MeshConfig(data=FLAGS.mesh_data, tensor=FLAGS.mesh_tensor))
          if (FLAGS.mesh_data, FLAGS.mesh_tensor) != (1, 1) else None)
  sampler = SamplerConfig(FLAGS.temperature, FLAGS.top_k, FLAGS.top_p)
  if mesh:
    policy = dataclasses.replace(policy, params=shard_params(mesh, policy.params))
  proposer = tree = heads = None
  if FLAGS.engine == 'specroll':
    group = FLAGS.num_samples > 1 if FLAGS.group_drafts is None else FLAGS.group_drafts
    if not FLAGS.proposer_dir and not group:
      sys.exit('error: --engine=specroll needs --proposer_dir (a directory from '
               'experiments.train_heads) or --group_drafts')
    if FLAGS.proposer_dir:
      kind = KINDS[saved_kind_name(FLAGS.proposer_dir)]
      warm = kind.load(policy, Path(FLAGS.proposer_dir))
      heads = warm.params
      proposer = kind.drafting(policy, warm, sampler, tuple(int(b) for b in FLAGS.branching))
    if group:
      proposer = GroupProposer(GroupDraftConfig(), base=proposer)
    tree = tree_config(policy, max_nodes=FLAGS.max_nodes, capacity_tokens=FLAGS.capacity_tokens)
  rollout = RolloutConfig(FLAGS.max_new_tokens, FLAGS.max_batch)
  engine = build_engine(policy, FLAGS.engine, sampler, proposer=proposer, tree=tree, mesh=mesh,
                        tree_attention=FLAGS.tree_attention,
                        gate=GateConfig() if FLAGS.speculation_gate else None,
                        workload=PricingWorkload(policy.params, heads, rollout, prompts,
                                                 FLAGS.num_samples, FLAGS.size_trees))
  params = engine.params(policy.params, heads)
  driver = Driver(engine, rollout)
  with tqdm(total=len(prompts) * FLAGS.num_samples, desc='responses', file=sys.stderr) as bar:
    responses = driver.generate(params, prompts, FLAGS.num_samples, FLAGS.seed, progress=bar)
  out = Path(FLAGS.out)
  write_jsonl_atomic(out, ({'prompt_index': r.prompt_index, 'sample_index': r.sample_index,
                            'token_ids': r.token_ids,
                            'text': policy.tokenizer.decode(r.token_ids, skip_special_tokens=True),
                            'logprobs': r.logprobs, 'finish_reason': r.finish_reason}
                           for r in responses))
  print(f'wrote {len(responses)} responses to {out}', file=sys.stderr)
  print('stats ' + json.dumps({'engine': FLAGS.engine, **engine.summarize(responses)}))


if __name__ == '__main__':
  app.run(main)
