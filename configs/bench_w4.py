"""W4: the GRPO tail. SmolLM2-135M-Instruct on 4 GSM8K test questions x 8 samples, T = 1.

  python -m experiments.bench.rollout --config=configs/bench_w4.py

One GRPO-shaped batch of 32 responses with EOS on and a long cap (512 new tokens): as
responses finish the driver compacts into smaller buckets, and the README's bucket table
reports, per bucket, vanilla's share of its decode time and each speculative engine's
width, price, tau and speedup there. On this model the batch stops at 16 rows: about a
third of its T = 1 answers never stop and end together at the cap (WORKSPACE_NOTES,
Known gaps), so there is no tail of 1-4 rows. The heads are W3's (the same
warm start and heads_dir).
"""
from configs import bench_w3


def get_config():
  c = bench_w3.get_config()
  c.num_prompts = 4
  c.samples_per_prompt = 8
  c.max_new_tokens = 512
  c.repeats = 3
  c.batch_sweep = (32,)  # the main run alone: its buckets are what this workload is about
  c.hf_generate = False
  c.roofline_batch = 0
  c.out_dir = 'results/bench_w4'
  return c
