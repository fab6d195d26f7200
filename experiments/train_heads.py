"""Warm-starts horizon heads, or a drafter (sequential or context-attending), by
self-distillation on the policy's own sampled generations.

  python -m experiments.train_heads --checkpoint=specroll_jax/tasks/stories260K --out=workdir/heads

Generates `--num_sequences` responses with the vanilla engine (from `--prompts`, or from BOS
alone when no prompts file is given), runs one policy forward over them for the targets
(the policy's top-K law at every position), trains with Optax, and prints the held-out
agreement with the realised tokens: per head top-1 / top-5 before and after training, or
per drafter depth the top-1 agreement and the policy's probability of the top-1 draft.

The heads recipe for a real model (SmolLM2-135M-Instruct, GSM8K train questions as chat
turns, an 8,192-token draft vocabulary; about 25 minutes on a 2-core CPU, what
configs/bench_w3.py and configs/drafts_w3.py run when their heads are missing):

  python -m experiments.train_heads --checkpoint=workdir/models/smollm2-135m-instruct \
    --gsm8k_train --num_sequences=512 --chat_template --held_out=32 --max_new_tokens=256 \
    --draft_vocab_size=8192 --steps=300 --batch_size=16 \
    --out=workdir/heads_smollm2_gsm8k_draft_vocab

The drafter recipe (same data, more of it; about 38 minutes, what configs/drafts_w3.py runs
when its drafter is missing):

  python -m experiments.train_heads --proposer=drafter \
    --checkpoint=workdir/models/smollm2-135m-instruct --gsm8k_train --num_sequences=768 \
    --chat_template --held_out=32 --max_new_tokens=256 --steps=400 --batch_size=16 \
    --learning_rate=2e-3 --hidden_multiplier=2.0 --out=workdir/drafter_smollm2_gsm8k

--proposer=context_drafter trains the context-attending drafter (speculative/
context_drafter.py) with the same flags and --context_heads attention heads.
"""
import time
from pathlib import Path

from absl import app, flags

from experiments.lib.common import DEFAULT_CHECKPOINT, read_prompts
from specroll_jax import load_policy
from specroll_jax.adapt import distill
from specroll_jax.adapt.drafter_training import DrafterTraining, warm_start_drafter
from specroll_jax.speculative.context_drafter import ContextDrafterConfig
from specroll_jax.speculative.drafter import DrafterConfig
from specroll_jax.speculative.heads import HeadsConfig
from specroll_jax.tasks.sources import load_tasks

flags.DEFINE_string('checkpoint', str(DEFAULT_CHECKPOINT), 'HF-format policy directory.')
flags.DEFINE_string('out', None, 'Directory to write the heads to.')
flags.DEFINE_enum('proposer', 'heads', ['heads', 'drafter', 'context_drafter'],
                  'Horizon heads, the sequential drafter (speculative/drafter.py) or the '
                  'context-attending drafter (speculative/context_drafter.py).')
flags.DEFINE_integer('context_heads', 4, '--proposer=context_drafter: attention heads.')
flags.DEFINE_string('prompts', None, 'Optional JSONL prompts; default: generate from BOS.')
flags.DEFINE_bool('gsm8k_train', False,
                  'Instead of --prompts: GSM8K train questions, one per generation (data from '
                  '--data_dir, default $SPECROLL_DATA_DIR then ../shared/data).')
flags.DEFINE_string('data_dir', None, 'Data directory for --gsm8k_train.')
flags.DEFINE_bool('chat_template', False,
                  'Each prompt as a user turn through the tokenizer\'s chat template '
                  '(instruct models; base models keep raw prompts).')
flags.DEFINE_integer('num_sequences', 512, 'Training generations.')
flags.DEFINE_integer('held_out', 64, 'Held-out generations for the agreement report.')
flags.DEFINE_integer('max_new_tokens', 256, 'Tokens per generation.')
flags.DEFINE_float('temperature', 1.0, 'Sampling temperature of the generations.')
flags.DEFINE_integer('num_heads', 4, 'Horizon heads (the drafter: its depth).')
flags.DEFINE_integer('draft_vocab_size', 8192,
                     'The frequency-ranked draft vocabulary of the heads or drafter (0, or the '
                     'policy\'s vocabulary size or more: the whole vocabulary).')
flags.DEFINE_float('hidden_multiplier', 1.0,
                   'Head (or drafter) block width in units of the hidden size.')
flags.DEFINE_integer('steps', 800, 'Optimizer steps.')
flags.DEFINE_integer('batch_size', 32, 'Sequences per step.')
flags.DEFINE_float('learning_rate', 3e-3, 'AdamW learning rate.')
flags.DEFINE_float('feature_weight', 0.0,
                   '--proposer=drafter: weight of the feature loss '
                   '(DrafterTraining.feature_weight; '
                   'experiments.measure.drafter_training_ablation measures it).')
flags.DEFINE_integer('seed', 0, 'Seed for generation, init and batching.')
flags.mark_flags_as_required(['out'])
FLAGS = flags.FLAGS


def report(name, rates):
  for k, row in enumerate(rates):
    print(f'{name} head {k + 1}: top-1 {row[0]:.3f}  top-5 {row[:5].sum():.3f}')


def training_prompts(policy) -> list:
  if FLAGS.gsm8k_train:
    count = FLAGS.num_sequences + FLAGS.held_out
    tasks = load_tasks('gsm8k', count=count, seed=FLAGS.seed, data_dir=FLAGS.data_dir,
                       split='train', chat=FLAGS.chat_template)[:count]
    return [policy.prompt_ids(t.prompt, FLAGS.chat_template) for t in tasks]
  if FLAGS.prompts:
    texts = read_prompts(Path(FLAGS.prompts))
    return [policy.prompt_ids(t, FLAGS.chat_template) for t in texts]
  return [[policy.config.bos_token_id]]


def main(argv):
  del argv
  start = time.perf_counter()
  policy = load_policy(FLAGS.checkpoint)
  prompts = training_prompts(policy)
  plan = distill.WarmStart(num_sequences=FLAGS.num_sequences, held_out=FLAGS.held_out,
                           max_new_tokens=FLAGS.max_new_tokens, temperature=FLAGS.temperature,
                           seed=FLAGS.seed)
  if FLAGS.proposer != 'heads':
    config = DrafterConfig(depth=FLAGS.num_heads, hidden_multiplier=FLAGS.hidden_multiplier,
                           draft_vocab_size=FLAGS.draft_vocab_size)
    if FLAGS.proposer == 'context_drafter':
      config = ContextDrafterConfig.from_block(config, FLAGS.context_heads)
    training = DrafterTraining(batch_size=FLAGS.batch_size, steps=FLAGS.steps,
                               learning_rate=FLAGS.learning_rate,
                               feature_weight=FLAGS.feature_weight)
    _, metadata = warm_start_drafter(policy, config, training, prompts, plan, FLAGS.out,
                                     source=str(FLAGS.checkpoint))
    for d, (top1, mass) in enumerate(zip(metadata.top1_by_depth, metadata.mass_by_depth), 1):
      print(f'{FLAGS.proposer} depth {d}: top-1 {top1:.3f}  '
            f'policy probability of the top-1 {mass:.3f}')
    print(f'draft vocabulary: {metadata.vocab_coverage:.3f} of held-out drawn tokens')
    print(f'saved the {FLAGS.proposer} to {FLAGS.out} ({metadata.seconds / 60:.1f} min)')
    return
  heads_config = HeadsConfig(FLAGS.num_heads, FLAGS.hidden_multiplier)
  config = distill.DistillConfig(batch_size=FLAGS.batch_size, steps=FLAGS.steps,
                                 learning_rate=FLAGS.learning_rate,
                                 draft_vocab_size=FLAGS.draft_vocab_size)
  result = distill.warm_start_and_save(policy, heads_config, config, prompts, plan, FLAGS.out,
                                       source=str(FLAGS.checkpoint))
  report('before', result.rank_hit_rate_before)
  report('after', result.rank_hit_rate_after)
  print(f'draft vocabulary: {len(result.heads_config.draft_vocab) or "the whole"} tokens')
  print(f'saved heads to {FLAGS.out} ({(time.perf_counter() - start) / 60:.1f} min)')


if __name__ == '__main__':
  app.run(main)
