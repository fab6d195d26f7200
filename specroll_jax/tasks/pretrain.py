"""Pretraining the W1 policy from scratch on synthetic arithmetic word problems.

A small Llama (fp32, tied embeddings, GQA) learns prompt -> step-by-step solution -> EOS on
synthetic_math problems (mostly the easy split, some hard) by next-token cross-entropy on
the solution tokens, and is then scored greedily with the vanilla engine on held-out
problems of both splits. The hard-split accuracy is where GRPO starts: it should be well
above zero (rewards carry signal) and well below one (there is something left to learn).

Examples are packed several to a row; a block-diagonal causal mask and per-example
positions make each one see only itself, exactly as at generation time.

Training is defined by its steps alone (linear warmup, then cosine decay over max_steps),
never by elapsed time: a build stopped by a time budget gave a weaker policy on a busy
machine (hard accuracy 0.08 instead of 0.30-0.62), so the same config and seed give the same
policy however loaded the machine is (bit-identical on one machine; tests compare hashes).

Used by experiments/pretrain_policy.py and default_policy.ensure_default_policy.
"""
import dataclasses
import hashlib
import json
import math
import shutil
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from tqdm import tqdm

from specroll_jax.model.config import ModelConfig, RopeConfig
from specroll_jax.model.policy import Policy, load_tokenizer
from specroll_jax.model.transformer import Transformer, causal_mask
from specroll_jax.rollout.driver import Driver, RolloutConfig
from specroll_jax.rollout.sampling import SamplerConfig
from specroll_jax.speculative.factory import build_engine
from specroll_jax.tasks import rewards, synthetic_math
from specroll_jax.tasks.paths import STORIES260K_DIR

# The stories260K tokenizer (512 tokens, byte fallback, one token per digit).
DEFAULT_TOKENIZER_DIR = STORIES260K_DIR
REPORT_FILE = 'pretrain_report.json'
VOCAB_SIZE = 512
BOS_ID = 1
EOS_ID = 2


@dataclasses.dataclass(frozen=True)
class PretrainConfig:
  # Model.
  hidden_size: int = 128
  num_layers: int = 3
  num_heads: int = 4
  num_kv_heads: int = 2
  intermediate_size: int = 256
  # Data: a pool of training problems, a share of them from the hard split.
  train_problems: int = 100_000
  hard_fraction: float = 0.25
  # Share of examples shown as the solution alone (an arithmetic drill): its lines cost a
  # third of the tokens of a whole problem, and computing results is what the policy is
  # slowest to learn (reading the operands from the question comes much sooner).
  drill_fraction: float = 0.5
  row_width: int = 256      # tokens per packed row
  batch_rows: int = 8       # packed rows per step: many small steps beat few large ones here
  # Optimisation.
  learning_rate: float = 2e-3
  final_lr_fraction: float = 0.1
  warmup_steps: int = 50
  weight_decay: float = 0.1
  # About 7 minutes on an idle 2-core CPU; data and evaluation add about a minute.
  max_steps: int = 2400
  # Evaluation on held-out problems, greedy.
  eval_problems: int = 256  # per split
  max_new_tokens: int = 128
  seed: int = 0

  def __post_init__(self):
    if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
      raise ValueError(f'PretrainConfig: hidden_size={self.hidden_size} must be a multiple of '
                       f'num_heads={self.num_heads}, and num_heads of '
                       f'num_kv_heads={self.num_kv_heads}')


def model_config(config: PretrainConfig) -> ModelConfig:
  return ModelConfig(
      architecture='LlamaForCausalLM', vocab_size=VOCAB_SIZE, hidden_size=config.hidden_size,
      intermediate_size=config.intermediate_size, num_layers=config.num_layers,
      num_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
      head_dim=config.hidden_size // config.num_heads, max_position_embeddings=512,
      rms_norm_eps=1e-5, rope=RopeConfig(), tie_word_embeddings=True, qkv_bias=False,
      o_bias=False, bos_token_id=BOS_ID, eos_token_id=EOS_ID)


@partial(jax.jit, static_argnums=0)  # One compilation; eagerly, each op compiles (~7 s).
def init_params(config: ModelConfig, seed) -> dict:
  """Transformer.init for the structure, then HF Llama's initialiser (normal, std 0.02).

  Flax's default embedding init has std 1, which through the tied projection gives
  initial logits of std sqrt(hidden_size); small weights start training near uniform.
  """
  init_key, normal_key = jax.random.split(jax.random.key(seed))
  tokens = jnp.zeros((1, 1), jnp.int32)
  params = Transformer(config).init(init_key, tokens, tokens, jnp.ones((1, 1, 1), bool))['params']
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(normal_key, len(leaves))
  leaves = [0.02 * jax.random.normal(k, x.shape, x.dtype) if x.ndim >= 2 else x
            for k, x in zip(keys, leaves)]
  return jax.tree.unflatten(treedef, leaves)


@dataclasses.dataclass(frozen=True)
class Encoded:
  """Token sequences back to back: example i is tokens[starts[i]:starts[i + 1]]."""
  tokens: np.ndarray          # int32
  starts: np.ndarray          # int64 [N + 1]
  prompt_lengths: np.ndarray  # int64 [N]: tokens before the solution (BOS included)


def encode(tokenizer, texts, chunk: int = 8192) -> Encoded:
  """(prompt, solution) texts -> BOS + prompt + solution + EOS; the prompt is encoded
  alone, as the GRPO trainer will.

  In chunks, so the pool never exists as Python lists of ints all at once.
  """
  tokens, lengths, prompt_lengths = [], [], []
  for i in range(0, len(texts), chunk):
    part = texts[i:i + chunk]
    prompts = tokenizer([prompt for prompt, _ in part])['input_ids']
    solutions = tokenizer([solution for _, solution in part], add_special_tokens=False)['input_ids']
    sequences = [p + s + [EOS_ID] for p, s in zip(prompts, solutions)]
    tokens.append(np.concatenate(sequences).astype(np.int32))
    lengths.extend(len(s) for s in sequences)
    prompt_lengths.extend(len(p) for p in prompts)
  return Encoded(tokens=np.concatenate(tokens), starts=np.concatenate([[0], np.cumsum(lengths)]),
                 prompt_lengths=np.array(prompt_lengths))


@struct.dataclass
class Batch:
  tokens: jax.Array     # int32 [B, W]
  positions: jax.Array  # int32 [B, W]: position within the example
  segments: jax.Array   # int32 [B, W]: example number within the row, 0 = padding
  targets: jax.Array    # int32 [B, W]: the next token of the same example
  weights: jax.Array    # float32 [B, W]: 1 where the target is a solution token or EOS


class Packer:
  """Fills rows of `width` tokens with whole examples, endlessly, in shuffled order.

  First fit over a lookahead of upcoming examples: taking them strictly in order would
  leave most of a row empty whenever the next example is long. An example passed over
  stays in the lookahead for a later row: long (hard) ones are delayed, never skipped.
  """

  def __init__(self, data: Encoded, width: int, seed: int, lookahead: int = 64):
    self.data = data
    self.width = width
    self.lengths = np.diff(data.starts)
    if self.lengths.max() > width:
      raise ValueError(f'PretrainConfig.row_width={width} is shorter than a training example '
                       f'({self.lengths.max()} tokens)')
    self.order = self._shuffled_forever(np.random.default_rng(seed))
    self.waiting = [next(self.order) for _ in range(lookahead)]

  def _shuffled_forever(self, rng):
    while True:
      yield from rng.permutation(len(self.lengths))

  def _take_fitting(self, room: int):
    for k, i in enumerate(self.waiting):
      if self.lengths[i] <= room:
        self.waiting[k] = next(self.order)
        return i
    return None

  def batch(self, rows: int) -> Batch:
    width, data = self.width, self.data
    tokens, positions, segments, targets = (np.zeros((rows, width), np.int32) for _ in range(4))
    weights = np.zeros((rows, width), np.float32)
    for row in range(rows):
      col, segment = 0, 0
      while (i := self._take_fitting(width - col)) is not None:
        start, end = data.starts[i], data.starts[i + 1]
        n = end - start
        segment += 1
        tokens[row, col:col + n] = data.tokens[start:end]
        positions[row, col:col + n] = np.arange(n)
        segments[row, col:col + n] = segment
        targets[row, col:col + n - 1] = data.tokens[start + 1:end]
        weights[row, col + data.prompt_lengths[i] - 1:col + n - 1] = 1.0
        col += n
    return Batch(tokens=tokens, positions=positions, segments=segments, targets=targets,
                 weights=weights)


def loss_fn(model_config: ModelConfig, params, batch: Batch):
  """Mean next-token cross-entropy over the weighted (solution) positions."""
  valid = batch.segments > 0
  same_example = batch.segments[:, :, None] == batch.segments[:, None, :]
  model = Transformer(model_config)
  hidden, _ = model.apply({'params': params}, batch.tokens, batch.positions,
                          causal_mask(valid) & same_example)
  logits = model.apply({'params': params}, hidden, method=Transformer.project)
  logp = jax.nn.log_softmax(logits, axis=-1)
  nll = -jnp.take_along_axis(logp, batch.targets[..., None], axis=-1)[..., 0]
  return jnp.sum(nll * batch.weights) / jnp.maximum(jnp.sum(batch.weights), 1.0)


def make_optimizer(config: PretrainConfig) -> optax.GradientTransformation:
  """AdamW (no decay on norms) with clipping; the rate is set each step by train_step."""
  decay = lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)
  adamw = lambda learning_rate: optax.chain(
      optax.clip_by_global_norm(1.0),
      optax.adamw(learning_rate, b1=0.9, b2=0.95, weight_decay=config.weight_decay,
                  mask=decay))
  return optax.inject_hyperparams(adamw)(learning_rate=config.learning_rate)


def learning_rate(config: PretrainConfig, step: int) -> float:
  warmup = min(1.0, (step + 1) / config.warmup_steps)
  cosine = 0.5 * (1.0 + math.cos(math.pi * step / config.max_steps))
  floor = config.final_lr_fraction
  return config.learning_rate * warmup * (floor + (1.0 - floor) * cosine)


@partial(jax.jit, static_argnums=(0, 1), donate_argnums=(2, 3))
def train_step(model_config: ModelConfig, optimizer, params, opt_state, batch: Batch, lr):
  loss, grads = jax.value_and_grad(lambda p: loss_fn(model_config, p, batch))(params)
  opt_state.hyperparams['learning_rate'] = lr  # from the host-side schedule
  updates, opt_state = optimizer.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


@dataclasses.dataclass(frozen=True)
class TrainResult:
  params: dict
  steps: int
  seconds: float
  first_loss: float
  final_loss: float  # mean over the last 20 steps


def training_problems(config: PretrainConfig) -> list:
  hard = round(config.train_problems * config.hard_fraction)
  return (synthetic_math.make_problems('easy', config.train_problems - hard, config.seed)
          + synthetic_math.make_problems('hard', hard, config.seed))


def training_texts(config: PretrainConfig, problems) -> list[tuple[str, str]]:
  """(prompt, solution) per problem; drills have an empty prompt."""
  drill = np.random.default_rng(config.seed).random(len(problems)) < config.drill_fraction
  return [('' if d else synthetic_math.prompt(p.question), p.solution)
          for p, d in zip(problems, drill)]


def train(config: PretrainConfig, policy_config: ModelConfig, data: Encoded) -> TrainResult:
  """Trains fresh parameters for config.max_steps steps."""
  params = init_params(policy_config, config.seed)
  optimizer = make_optimizer(config)
  opt_state = optimizer.init(params)
  packer = Packer(data, config.row_width, config.seed)
  losses = []
  begin = time.monotonic()
  with tqdm(total=config.max_steps, desc='pretraining', file=sys.stderr) as bar:
    for step in range(config.max_steps):
      batch = packer.batch(config.batch_rows)
      lr = learning_rate(config, step)
      params, opt_state, loss = train_step(policy_config, optimizer, params, opt_state, batch,
                                           jnp.float32(lr))
      losses.append(float(loss))
      bar.update()
      bar.set_postfix(loss=f'{losses[-1]:.3f}', lr=f'{lr:.2e}')
  return TrainResult(params=params, steps=config.max_steps, seconds=time.monotonic() - begin,
                     first_loss=losses[0], final_loss=float(np.mean(losses[-20:])))


def evaluate(policy: Policy, problems, max_new_tokens: int, desc: str) -> tuple[float, list]:
  """Greedy accuracy (rewards.score, gsm8k) and the completions, via the vanilla engine."""
  engine = build_engine(policy, 'vanilla', SamplerConfig(temperature=0.0))
  driver = Driver(engine, RolloutConfig(max_new_tokens, max_batch=64))
  prompts = [policy.tokenizer.encode(synthetic_math.prompt(p.question)) for p in problems]
  with tqdm(total=len(prompts), desc=desc, file=sys.stderr) as bar:
    responses = driver.generate(policy.params, prompts, 1, seed=0, progress=bar)
  completions = [policy.tokenizer.decode(r.token_ids, skip_special_tokens=True)
                 for r in responses]
  scores = [rewards.score(c, p.answer, 'gsm8k') for c, p in zip(completions, problems)]
  return float(np.mean(scores)), completions


def held_out(split: str, config: PretrainConfig, seen: set) -> list:
  """Evaluation problems of `split` whose question never occurs in the training pool."""
  candidates = synthetic_math.make_problems(split, 4 * config.eval_problems, config.seed + 1)
  fresh = [p for p in candidates if p.question not in seen][:config.eval_problems]
  if len(fresh) < config.eval_problems:
    raise ValueError(f'only {len(fresh)} held-out {split} problems differ from the training '
                     f'pool; lower PretrainConfig.eval_problems or train_problems')
  return fresh


def file_sha256(path: Path) -> str:
  return hashlib.sha256(path.read_bytes()).hexdigest()


def has_policy(directory: Path) -> bool:
  return (directory / 'config.json').is_file() and (directory / 'model.safetensors').is_file()


def pretrain(config: PretrainConfig, out: Path, overwrite: bool = False,
             tokenizer_dir: Path = DEFAULT_TOKENIZER_DIR) -> dict:
  """Trains, evaluates and saves a policy to `out` (published whole, with its report)."""
  out = Path(out)
  if has_policy(out) and not overwrite:
    raise FileExistsError(f'{out}: already holds a policy (overwrite=True or --overwrite '
                          f'replaces it)')
  if out.exists() and not has_policy(out) and any(out.iterdir()):
    raise FileExistsError(f'{out}: exists and is not a policy directory; refusing to replace it')
  policy_config = model_config(config)
  tokenizer = load_tokenizer(Path(tokenizer_dir), policy_config)
  if (tokenizer.bos_token_id, tokenizer.eos_token_id) != (BOS_ID, EOS_ID):
    raise ValueError(f'{tokenizer_dir}: tokenizer has BOS/EOS ids {tokenizer.bos_token_id}/'
                     f'{tokenizer.eos_token_id}; the W1 policy config uses {BOS_ID}/{EOS_ID}')
  problems = training_problems(config)
  result = train(config, policy_config, encode(tokenizer, training_texts(config, problems)))
  policy = Policy(policy_config, result.params, tokenizer)
  seen = {p.question for p in problems}
  accuracy, samples = {}, {}
  for split in ('easy', 'hard'):
    evaluation = held_out(split, config, seen)
    accuracy[split], completions = evaluate(policy, evaluation, config.max_new_tokens,
                                            f'evaluating {split}')
    samples[split] = [{'question': p.question, 'answer': p.answer, 'completion': c}
                      for p, c in zip(evaluation[:3], completions)]
  report = {
      'accuracy_easy': accuracy['easy'], 'accuracy_hard': accuracy['hard'],
      'parameters': int(sum(x.size for x in jax.tree.leaves(result.params))),
      'steps': result.steps, 'train_seconds': round(result.seconds, 1),
      'first_loss': result.first_loss, 'final_loss': result.final_loss,
      'config': dataclasses.asdict(config), 'samples': samples}
  return _publish(policy, report, out)


def _publish(policy: Policy, report: dict, out: Path) -> dict:
  """Writes the policy and report to a sibling temporary directory, then swaps it in, so
  `out` never holds half a policy (has_policy(out) means the whole save finished). Returns
  the report as written, with the weights' sha256."""
  out.parent.mkdir(parents=True, exist_ok=True)
  staging = Path(tempfile.mkdtemp(prefix=f'.{out.name}.', dir=out.parent))
  staging.chmod(0o755)  # mkdtemp makes it private; the policy is an ordinary directory.
  try:
    policy.save(staging)
    report = dict(report, model_sha256=file_sha256(staging / 'model.safetensors'))
    (staging / REPORT_FILE).write_text(json.dumps(report, indent=2) + '\n')
  except BaseException:
    shutil.rmtree(staging)
    raise
  if out.exists():
    retired = Path(tempfile.mkdtemp(prefix=f'.{out.name}.old.', dir=out.parent))
    out.replace(retired / out.name)
    staging.replace(out)
    shutil.rmtree(retired)
  else:
    staging.replace(out)
  return report
