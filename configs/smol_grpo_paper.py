"""GRPO on SmolLM2-135M-Instruct shaped like the paper's runs, sized for a 2-core CPU.

  python3 -m experiments.import_gguf --out=workdir/models/smollm2-135m-instruct
  python3 -m experiments.train_grpo --config=configs/smol_grpo_paper.py \
      --workdir=workdir/smol_grpo_paper

configs/smol_grpo.py's job (GSM8K chat prompts, the format reward, full-parameter AdamW,
held-out evaluation, the audit) with the paper's shape: groups of 8, 4 prompts a step (32 rows
at each rollout's start), and a cap that leaves the batch a tail. At T=1 this model's answers
to GSM8K train questions are 56 / 238 / 512 tokens at the 10th / 50th / 90th percentile under
a cap of 512, 30% of them capped (results/smol_grpo_paper/lengths; under 256, 56% were capped
and most rows ran to the end): with 512, half the rows finish before step 240 and the rest
run on in ever smaller buckets. Drafts: the sequential drafter (the best of W3's learned
proposers, results/drafts_w3) on its (8, 4, 4, 2) spine with group drafts, trees sized by
the concurrency-aware budget (64 tokens: 2 nodes a row at 32 rows, 16 at 4), its slow path
on; its warm start is the size of experiments.measure.drafter_kinds' recipe (128 answers, 200
steps of 8). float32 compute: this job's machine (a 2-core AMD EPYC) has no AMX, and the bf16
compute mode is slower there (notes/history.md, "bf16 compute");
--config.policy.compute_dtype=bfloat16 runs it in bf16.
"""
from configs.smol_grpo import get_config as smol_config


def get_config():
  c = smol_config()
  c.steps = 12
  c.rollout.prompts_per_step = 4
  c.rollout.group_size = 8
  c.rollout.driver.update(max_new_tokens=512, max_batch=32)
  c.rollout.proposers = 'drafter,group'
  c.rollout.tree.update(capacity_tokens=64, max_nodes=16)
  c.drafter.update(branching=(8, 4, 4, 2), num_sequences=128, held_out=16)
  c.drafter.model.draft_vocab_size = 8192
  c.drafter.training.update(steps=200, batch_size=8)
  c.adaptation.mode = 'slow'
  return c
