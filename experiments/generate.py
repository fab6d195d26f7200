"""Samples G responses per prompt from an HF checkpoint and writes them as JSONL.

  python -m experiments.generate --checkpoint=../shared/models/stories260K \
      --prompts=prompts.jsonl --num_samples=4 --out=samples.jsonl
"""
import json
import sys
from pathlib import Path

from absl import app, flags
from tqdm import tqdm

from specroll_jax import load_policy
from specroll_jax.decode import VanillaEngine
from specroll_jax.mesh import MeshConfig, data_size, make_mesh, shard_params
from specroll_jax.rollout import Driver, RolloutConfig
from specroll_jax.sampling import SamplerConfig

DEFAULT_CHECKPOINT = Path(__file__).resolve().parents[2] / 'shared' / 'models' / 'stories260K'

flags.DEFINE_string('checkpoint', str(DEFAULT_CHECKPOINT), 'HF-format policy directory.')
flags.DEFINE_string('prompts', None, 'JSONL file with one {"prompt": "..."} per line.')
flags.DEFINE_integer('num_samples', 1, 'Responses per prompt (G).')
flags.DEFINE_float('temperature', 1.0, 'Sampling temperature; 0 means greedy.')
flags.DEFINE_integer('top_k', 0, 'Keep the k most likely tokens; 0 disables.')
flags.DEFINE_float('top_p', 1.0, 'Nucleus mass; 1.0 disables.')
flags.DEFINE_integer('max_new_tokens', 128, 'Maximum generated tokens per response.')
flags.DEFINE_integer('seed', 0, 'Rollout seed (see the randomness contract in sampling.py).')
flags.DEFINE_enum('engine', 'vanilla', ['vanilla'], 'Rollout engine.')
flags.DEFINE_integer('max_batch', 64, 'Largest compiled batch bucket.')
flags.DEFINE_integer('mesh_data', 1, 'Devices on the data axis (-1: all).')
flags.DEFINE_enum('dtype', 'float32', ['float32', 'bfloat16'], 'Parameter dtype.')
flags.DEFINE_string('out', None, 'Output JSONL path.')
flags.mark_flags_as_required(['prompts', 'out'])
FLAGS = flags.FLAGS


def read_prompts(path: Path) -> list[str]:
  if not path.is_file():
    raise FileNotFoundError(f'{path}: prompts file not found')
  prompts = []
  for number, line in enumerate(path.read_text().splitlines(), 1):
    if not line.strip():
      continue
    try:
      row = json.loads(line)
    except json.JSONDecodeError as e:
      raise ValueError(f'{path}:{number}: not valid JSON ({e})') from None
    if not isinstance(row, dict) or not isinstance(row.get('prompt'), str):
      raise ValueError(f'{path}:{number}: expected an object with a string field "prompt"')
    prompts.append(row['prompt'])
  if not prompts:
    raise ValueError(f'{path}: no prompts')
  return prompts


def main(argv):
  del argv
  policy = load_policy(FLAGS.checkpoint, dtype=FLAGS.dtype)
  texts = read_prompts(Path(FLAGS.prompts))
  prompts = [policy.tokenizer.encode(t) for t in texts]
  mesh = make_mesh(MeshConfig(data=FLAGS.mesh_data)) if FLAGS.mesh_data != 1 else None
  sampler = SamplerConfig(FLAGS.temperature, FLAGS.top_k, FLAGS.top_p)
  eos_ids = () if policy.config.eos_token_id is None else (policy.config.eos_token_id,)
  engine = VanillaEngine(policy.config, sampler, eos_ids, mesh=mesh)
  driver = Driver(engine, RolloutConfig(FLAGS.max_new_tokens, FLAGS.max_batch),
                  data_size=data_size(mesh) if mesh else 1)
  params = shard_params(mesh, policy.params) if mesh else policy.params
  with tqdm(total=len(prompts) * FLAGS.num_samples, desc='responses', file=sys.stderr) as bar:
    responses = driver.generate(params, prompts, FLAGS.num_samples, FLAGS.seed, progress=bar)
  out = Path(FLAGS.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  tmp = out.with_suffix(out.suffix + '.tmp')
  with tmp.open('w') as f:
    for r in responses:
      f.write(json.dumps({'prompt_index': r.prompt_index, 'sample_index': r.sample_index,
                          'token_ids': r.token_ids,
                          'text': policy.tokenizer.decode(r.token_ids, skip_special_tokens=True),
                          'logprobs': r.logprobs, 'finish_reason': r.finish_reason}) + '\n')
  tmp.replace(out)
  tokens = sum(len(r.token_ids) for r in responses)
  print(f'wrote {len(responses)} responses ({tokens} tokens) to {out}', file=sys.stderr)


if __name__ == '__main__':
  app.run(main)
