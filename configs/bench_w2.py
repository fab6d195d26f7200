"""W2: stories260K with warm-started heads, 64 story openings x 256 new tokens, T = 1.

  python -m experiments.bench.rollout --config=configs/bench_w2.py
"""
import ml_collections

from specroll_jax.tasks.paths import REPO_DIR, STORIES260K_DIR


def get_config():
  c = ml_collections.ConfigDict()
  # Relative to the repository (where experiments run), so results record no machine path.
  c.checkpoint = str(STORIES260K_DIR.relative_to(REPO_DIR))
  c.heads_dir = 'workdir/heads_stories260K'  # trained (and cached) here when missing
  c.heads = ml_collections.ConfigDict(dict(
      prompts='bos', num_heads=4, draft_vocab_size=0, num_sequences=512, held_out=64,
      max_new_tokens=256,
      steps=800, batch_size=32, seed=0))
  c.prompts = 'story_openings'
  c.chat_template = False
  c.data_dir = ml_collections.FieldReference(None, field_type=str)
  c.num_prompts = 64
  c.samples_per_prompt = 1
  c.opening_tokens = 6       # openings = the first tokens of the policy's own stories
  c.opening_seed = 1234      # different from the heads' training seed
  # A fixed prompt set compiles once per width, so finer widths cost no compilations.
  c.prompt_buckets_per_octave = 4
  c.max_new_tokens = 256
  c.dtype = 'float32'  # of the policy (and of transformers' copy when hf_generate)
  c.compute_dtype = 'float32'  # or 'bfloat16': ModelConfig.compute_dtype
  c.temperature = 1.0
  c.seed = 0
  c.repeats = 3
  c.capacity_tokens = 0      # 0: the cached capacity profile of this model on this backend
  c.capacity_per_batch = True  # the profile's knee at each batch size, not one C_hw
  # Plain steps wherever a tree is not expected to pay for its measured cost (speculative/gate.py).
  c.speculation_gate = True
  # Each bucket's tree width from the measured price and tokens per step of 2, 4, ... nodes
  # (speculative/step_cost.py size_trees) instead of C_hw // B alone.
  c.size_trees = False
  c.max_nodes = 64
  c.branching = (8, 4, 2, 2)
  c.batch_sweep = (8, 16, 32, 64)  # active batch sizes for the tau / speedup curves
  c.hf_generate = False
  c.hf_threads = 2
  c.roofline_batch = 0           # 0: no roofline probe
  c.out_dir = 'results/bench_w2'
  return c
