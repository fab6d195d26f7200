"""Our vanilla engine against transformers' generate (torch, CPU), same prompts and lengths.

  python -m experiments.bench_vanilla --out_dir=results/bench_vanilla

Both engines sample at temperature 1 and must produce exactly max_new_tokens per response
(EOS disabled), so both do the same number of decode steps. Each engine is warmed up once,
then timed `--repeats` times, alternating engines; the ratio of medians is reported.
"""
import json
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
from specroll_jax.rollout.vanilla import VanillaEngine
from experiments.common import DEFAULT_CHECKPOINT

flags.DEFINE_integer('num_prompts', 64, 'Prompts (one sample each) per generate call.')
flags.DEFINE_integer('max_new_tokens', 128, 'Generated tokens per response.')
flags.DEFINE_integer('repeats', 3, 'Timed repetitions per engine.')
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


def bench_model(name: str, directory: Path) -> dict:
  policy = load_policy(directory)
  texts = [STORY_OPENINGS[i % len(STORY_OPENINGS)] for i in range(FLAGS.num_prompts)]
  prompts = [policy.tokenizer.encode(t) for t in texts]
  new = FLAGS.max_new_tokens
  engine = VanillaEngine(policy.config, SamplerConfig(temperature=1.0), eos_ids=())
  driver = Driver(engine, RolloutConfig(max_new_tokens=new, max_batch=FLAGS.num_prompts))
  ours = lambda: driver.generate(policy.params, prompts, 1, seed=0)

  hf = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
  hf.eval()
  tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory))
  tokenizer.pad_token, tokenizer.padding_side = tokenizer.unk_token, 'left'
  batch = tokenizer(texts, return_tensors='pt', padding=True)

  def theirs():
    with torch.no_grad():
      return hf.generate(**batch, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                         max_new_tokens=new, min_new_tokens=new, pad_token_id=0)

  assert all(len(r.token_ids) == new for r in ours())
  assert theirs().shape[1] == batch['input_ids'].shape[1] + new
  ours_t, theirs_t = [], []
  for _ in range(FLAGS.repeats):
    ours_t += _time(ours, 1)
    theirs_t += _time(theirs, 1)
  tokens = FLAGS.num_prompts * new
  ours_s, theirs_s = statistics.median(ours_t), statistics.median(theirs_t)
  params = sum(x.size for x in jax.tree.leaves(policy.params))
  return {'model': name, 'parameters': int(params), 'batch': FLAGS.num_prompts,
          'new_tokens': new, 'ours_seconds': ours_t, 'hf_generate_seconds': theirs_t,
          'ours_tokens_per_s': tokens / ours_s, 'hf_tokens_per_s': tokens / theirs_s,
          'speedup_vs_hf_generate': theirs_s / ours_s}


def main(argv):
  del argv
  with tempfile.TemporaryDirectory() as tmp:
    rows = [bench_model('stories260K', DEFAULT_CHECKPOINT),
            bench_model('random-llama-7M', _random_llama_dir(Path(tmp)))]
  out = Path(FLAGS.out_dir)
  out.mkdir(parents=True, exist_ok=True)
  result = {'command': 'python -m experiments.bench_vanilla',
            'backend': jax.default_backend(), 'cpu_count': torch.get_num_threads(),
            'machine': platform.processor() or platform.machine(),
            'jax': jax.__version__, 'torch': torch.__version__,
            'transformers': transformers.__version__,
            'speedup_vs_hf_generate': {r['model']: r['speedup_vs_hf_generate'] for r in rows},
            'models': rows}
  (out / 'results.json').write_text(json.dumps(result, indent=2) + '\n')
  lines = ['| model | params | batch x new | ours tok/s | HF generate tok/s | speedup |',
           '|---|---:|---:|---:|---:|---:|']
  for r in rows:
    lines.append(f"| {r['model']} | {r['parameters']:,} | {r['batch']} x {r['new_tokens']} | "
                 f"{r['ours_tokens_per_s']:.0f} | {r['hf_tokens_per_s']:.0f} | "
                 f"{r['speedup_vs_hf_generate']:.2f}x |")
  table = '\n'.join(lines)
  (out / 'README.md').write_text(
      f'# Vanilla engine vs transformers generate\n\nCommand: `python -m experiments.bench_vanilla`'
      f' ({jax.default_backend()}, {torch.get_num_threads()} torch threads)\n\n{table}\n')
  print(table)


if __name__ == '__main__':
  app.run(main)
