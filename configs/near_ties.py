"""Sampling near-ties on W3 (SmolLM2-135M-Instruct, 49k vocabulary) and stories260K (512).

  python -m experiments.measure.near_ties --config=configs/near_ties.py

W3 is the group-draft benchmark's GSM8K chat prompts at 256 new tokens, T = 1; stories260K
is W2's story openings at 160 new tokens. `block` = 8 is the depth of W3's trees (a tree
step verifies up to 8 nodes per row there); `seeds` keys per position multiply the draws
without another forward.
"""
import ml_collections

from configs.bench_w2 import get_config as w2_config
from configs.bench_w3 import get_config as w3_config

KEPT = ('checkpoint', 'data_dir', 'prompts', 'chat_template', 'num_prompts', 'samples_per_prompt',
        'dtype', 'temperature', 'seed', 'opening_tokens', 'opening_seed')


def workload(base, **overrides):
  c = ml_collections.ConfigDict({k: base[k] for k in KEPT if k in base})
  c.update(block=8, repeats=20, **overrides)
  return c


def get_config():
  c = ml_collections.ConfigDict()
  c.workloads = ml_collections.ConfigDict(dict(
      w3=workload(w3_config(), num_prompts=16, samples_per_prompt=4, max_new_tokens=256,
                  seeds=8),
      stories260K=workload(w2_config(), num_prompts=64, samples_per_prompt=1,
                           max_new_tokens=160, seeds=256)))
  c.run = ('stories260K', 'w3')
  c.out_dir = 'results/near_ties'
  return c
