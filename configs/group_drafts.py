"""Group drafts on W1 and W3: the heads alone, group drafts alone and both, against vanilla.

  python -m experiments.bench.group_drafts --config=configs/group_drafts.py

Each workload runs twice in one process: with every step a tree (no speculation gate), for
tau at a fixed budget, and with the gate, for the generation speedup a run would get.
W1 is the GRPO main job's rollout (the W1 policy, 8 hard synthetic problems x 8 samples,
64 new tokens) at the adaptation ablation's fixed C_hw of 512 tokens, where the heads alone
reached tau 2.9. W3 is SmolLM2-135M-Instruct on GSM8K chat prompts x 4 samples; on a
2-core CPU a 16 x 4 batch takes about 2.5 minutes per vanilla run, so the default is 4 x 4
(16 responses in flight) with C_hw = 128 (8 nodes per response).
"""
import ml_collections

from configs.bench_w3 import get_config as w3_config
from specroll_jax.rl.sections import section
from specroll_jax.speculative.group_proposer import GroupDraftConfig


def w1_config():
  c = ml_collections.ConfigDict()
  c.checkpoint = ''  # '' = the committed W1 policy
  c.policy_cache_dir = 'workdir/policies'
  c.data_dir = ml_collections.FieldReference(None, field_type=str)
  c.prompts = 'synthetic:hard'
  c.chat_template = False
  c.num_prompts = 8
  c.samples_per_prompt = 8
  # The main job's heads (configs/tiny_math.py); warm-started here with its settings when
  # missing. Seed 1: prompts the heads were not trained on (they used seed 0's first 576).
  c.heads_dir = 'workdir/tiny_math/heads'
  c.heads = ml_collections.ConfigDict(dict(
      prompts='synthetic:hard', num_heads=4, draft_vocab_size=0, num_sequences=512, held_out=64,
      max_new_tokens=64,
      steps=600, batch_size=32, seed=0))
  c.seed = 1
  c.prompt_buckets_per_octave = 4
  c.max_new_tokens = 64
  c.dtype = 'float32'
  c.temperature = 1.0
  c.repeats = 3
  c.capacity_tokens = 512
  c.capacity_per_batch = False
  c.max_nodes = 64
  c.branching = (8, 4, 2, 2)
  c.hf_generate = False
  return c


def get_config():
  c = ml_collections.ConfigDict()
  w3 = w3_config()
  w3.num_prompts = 4
  w3.capacity_tokens = 128
  w3.hf_generate = False
  w3.roofline_batch = 0
  c.workloads = ml_collections.ConfigDict(dict(w1=w1_config(), w3=w3))
  for workload in c.workloads.values():
    workload.group = section(GroupDraftConfig)
    workload.speculation_gate = False  # set per run by the benchmark
    workload.size_trees = False  # the widths C_hw gives, as in its committed results
  c.engines = ('vanilla', 'specroll', 'group', 'both')
  c.run = ('w1', 'w3')  # the workloads measured now; results.json gathers every one measured
  c.modes = ('fixed_budget', 'gated')
  c.out_dir = 'results/group_drafts'
  return c
