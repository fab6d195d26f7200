"""Our vanilla engine against transformers' generate (torch, CPU), same prompts and lengths.

  python -m experiments.bench.vanilla --out_dir=results/bench_vanilla

Both engines get the same prompt token ids, sample at temperature 1 and must produce exactly
max_new_tokens per response (EOS disabled), so both do the same number of decode steps.
Each engine is warmed up once, then timed `--repeats` times, alternating engines; the ratio
of medians is reported. Models: stories260K and a random 8.4M-parameter Llama on story
openings (`--num_prompts` x `--max_new_tokens`), and W3, SmolLM2-135M-Instruct (imported
with experiments.import_gguf) on GSM8K test questions through its chat template, at each
batch size of `--w3_batches`.
"""
import platform
import statistics
import tempfile
import time
from pathlib import Path

import jax
import torch
import transformers
from absl import app, flags

from specroll_jax import load_policy
from specroll_jax.rollout.driver import Driver, RolloutConfig
from specroll_jax.rollout.sampling import SamplerConfig
from specroll_jax.speculative.factory import build_engine
from specroll_jax.tasks.data import load_dataset
from experiments.lib.common import DEFAULT_CHECKPOINT, left_padded
from experiments.lib.results import Result, Table, command_line, write

flags.DEFINE_integer('num_prompts', 64, 'Prompts (one sample each) per generate call.')
flags.DEFINE_integer('max_new_tokens', 128, 'Generated tokens per response.')
flags.DEFINE_integer('repeats', 3, 'Timed repetitions per engine.')
flags.DEFINE_integer('prompt_buckets_per_octave', 4,
                     'Prompt widths per octave (rollout.buckets.prompt_bucket).')
flags.DEFINE_string('w3_dir', 'workdir/models/smollm2-135m-instruct',
                    'The imported SmolLM2-135M-Instruct directory (experiments.import_gguf); '
                    'empty skips W3.')
flags.DEFINE_list('w3_batches', ['16', '4'], 'W3 batch sizes (GSM8K test questions).')
flags.DEFINE_integer('w3_max_new_tokens', 128, 'Generated tokens per W3 response.')
flags.DEFINE_string('data_dir', None,
                    'Data directory (default: $SPECROLL_DATA_DIR, then ../shared/data).')
flags.DEFINE_string('out_dir', 'results/bench_vanilla', 'Where results.json and README.md go.')
FLAGS = flags.FLAGS

STORY_OPENINGS = ['Once upon a time', 'Lily and Tom went to the park', 'The little dog was sad',
                  'One day, a big bird', 'Tim had a red ball', 'The sun was hot and']

RANDOM_LLAMA = dict(vocab_size=4096, hidden_size=256, intermediate_size=768,
                    num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                    max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                    tie_word_embeddings=False)


def _random_llama_dir(directory: Path) -> Path:
  torch.manual_seed(0)
  model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**RANDOM_LLAMA))
  model.save_pretrained(str(directory))
  for name in ('tokenizer.json', 'tokenizer_config.json', 'special_tokens_map.json'):
    (directory / name).write_bytes((DEFAULT_CHECKPOINT / name).read_bytes())
  return directory


def _time(fn, repeats):
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return times


def bench_model(name: str, directory: Path, prompts: list[list[int]], new: int) -> dict:
  policy = load_policy(directory)
  engine = build_engine(policy, 'vanilla', SamplerConfig(temperature=1.0), eos_ids=())
  driver = Driver(engine, RolloutConfig(max_new_tokens=new, max_batch=len(prompts),
                                        prompt_buckets_per_octave=FLAGS.prompt_buckets_per_octave))
  ours = lambda: driver.generate(policy.params, prompts, 1, seed=0)

  hf = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
  hf.eval()
  pad_id = 0  # masked out by the attention mask; only its shape matters
  batch = left_padded(prompts, pad_id)

  def theirs():
    with torch.no_grad():
      return hf.generate(**batch, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                         max_new_tokens=new, min_new_tokens=new, pad_token_id=pad_id)

  assert all(len(r.token_ids) == new for r in ours())
  assert theirs().shape[1] == batch['input_ids'].shape[1] + new
  ours_t, theirs_t = [], []
  for _ in range(FLAGS.repeats):
    ours_t += _time(ours, 1)
    theirs_t += _time(theirs, 1)
  tokens = len(prompts) * new
  ours_s, theirs_s = statistics.median(ours_t), statistics.median(theirs_t)
  params = sum(x.size for x in jax.tree.leaves(policy.params))
  return {'model': name, 'parameters': int(params), 'batch': len(prompts),
          'prompt_tokens': [len(p) for p in prompts],
          'new_tokens': new, 'ours_seconds': ours_t, 'hf_generate_seconds': theirs_t,
          'ours_tokens_per_s': tokens / ours_s, 'hf_tokens_per_s': tokens / theirs_s,
          'speedup_vs_hf_generate': theirs_s / ours_s}


def story_prompts(directory: Path) -> list[list[int]]:
  tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory))
  return [tokenizer.encode(STORY_OPENINGS[i % len(STORY_OPENINGS)])
          for i in range(FLAGS.num_prompts)]


def gsm8k_chat_prompts(directory: Path, count: int) -> list[list[int]]:
  """The first `count` GSM8K test questions as chat user turns (the GRPO task prompt)."""
  policy = load_policy(directory)
  examples = load_dataset('gsm8k', FLAGS.data_dir, split='test', chat=True).examples[:count]
  return [policy.prompt_ids(e.prompt, chat_template=True) for e in examples]


def main(argv):
  del argv
  new = FLAGS.max_new_tokens
  with tempfile.TemporaryDirectory() as tmp:
    random_dir = _random_llama_dir(Path(tmp))
    rows = [bench_model('stories260K', DEFAULT_CHECKPOINT, story_prompts(DEFAULT_CHECKPOINT), new),
            bench_model('random-llama-7M', random_dir, story_prompts(random_dir), new)]
  if FLAGS.w3_dir:
    w3 = Path(FLAGS.w3_dir)
    if not (w3 / 'config.json').is_file():
      raise FileNotFoundError(f'{w3}: no imported SmolLM2 (run experiments.import_gguf, or '
                              'pass --w3_dir= to skip W3)')
    for batch in map(int, FLAGS.w3_batches):
      rows.append(bench_model('smollm2-135m-instruct', w3, gsm8k_chat_prompts(w3, batch),
                              FLAGS.w3_max_new_tokens))
  write(report(rows), FLAGS.out_dir)


def report(rows) -> Result:
  table = Table(['model', 'params', 'batch x new', 'ours tok/s', 'HF generate tok/s', 'speedup'],
                [[r['model'], f"{r['parameters']:,}", f"{r['batch']} x {r['new_tokens']}",
                  f"{r['ours_tokens_per_s']:.0f}", f"{r['hf_tokens_per_s']:.0f}",
                  f"{r['speedup_vs_hf_generate']:.2f}x"] for r in rows], align='lrrrrr')
  return Result(
      title='Vanilla engine vs transformers generate',
      command=command_line('experiments.bench.vanilla'),
      data={'backend': jax.default_backend(), 'cpu_count': torch.get_num_threads(),
            'machine': platform.processor() or platform.machine(),
            'jax': jax.__version__, 'torch': torch.__version__,
            'transformers': transformers.__version__,
            'speedup_vs_hf_generate': {f"{r['model']}@{r['batch']}": r['speedup_vs_hf_generate']
                                       for r in rows},
            'models': rows},
      body=[f'Backend {jax.default_backend()}, {torch.get_num_threads()} torch threads.', table])


if __name__ == '__main__':
  app.run(main)
