"""SpecRoll as a rollout engine for tunix (the `google-tunix` package), the JAX post-training
library: `ClusterConfig(rollout_engine=functools.partial(SpecRollRollout, ...))` gives tunix's
GRPO learner this project's exact speculative rollouts without changing its trainer.

The contract, as google-tunix 0.1.7 calls it (`rl/rl_cluster.py`, `rl/grpo/grpo_learner.py`):
- `generate(prompts, rollout_config)` gets chat-formatted strings, each repeated G times in
  adjacent runs, and returns unpadded completion tokens without the EOS (the GRPO learner pads
  them with `pad_id()` and masks what equals it), one fixed width of left-padded prompt ids
  (`max_prompt_length`), the decoded text for the reward functions and, on request, the
  sampler's log-probs of each token. `rollout_config.seed` is the same on every call, so the
  engine advances its own seed per call.
- Weights arrive only through `update_params(state)`, with the actor's `nnx.Param` state at the
  end of every global step, and only because `model()` returns None (tunix syncs only an
  engine that does not share the actor). On a CPU backend that call runs under a transfer
  guard: the conversion to this project's params is one jitted function of device arrays.
- tunix's Qwen2 parameters map to this project's by renames and reshapes only (`_QWEN2_RULES`).

Nothing in the package imports this module: it sits above every layer and needs the optional
`requirements-tunix.txt`.
"""
import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util
from tunix.generate.tokenizer_adapter import TokenizerAdapter
from tunix.rl.rollout import base_rollout

from specroll_jax.model.config import ModelConfig, RopeConfig
from specroll_jax.model.policy import Policy
from specroll_jax.rl.grpo import token_logprobs
from specroll_jax.rollout.driver import Driver, RolloutConfig
from specroll_jax.rollout.response import FINISH_EOS
from specroll_jax.rollout.sampling import SamplerConfig
from specroll_jax.rl.learned_proposers import learned_kind_name, parse_proposers
from specroll_jax.speculative.factory import ENGINES, build_engine, with_group_drafts
from specroll_jax.speculative.group_proposer import GroupDraftConfig
from specroll_jax.speculative.tree import TreeConfig

# tunix Qwen2 parameter path -> (this project's path, how the array is reshaped). Our
# kernels are [in, out]; tunix keeps the attention heads as their own axes.
_QWEN2_RULES = (
    (r'embedder\.input_embedding', r'embed_tokens/embedding', 'same'),
    (r'final_norm\.w', r'norm/weight', 'same'),
    (r'lm_head\.w', r'lm_head/kernel', 'same'),
    (r'layers\.(\d+)\.input_layernorm\.w', r'layers_\1/input_layernorm/weight', 'same'),
    (r'layers\.(\d+)\.post_attention_layernorm\.w', r'layers_\1/post_attention_layernorm/weight',
     'same'),
    (r'layers\.(\d+)\.attn\.(q|k|v)_proj\.w', r'layers_\1/self_attn/\2_proj/kernel', 'in_heads'),
    (r'layers\.(\d+)\.attn\.o_proj\.w', r'layers_\1/self_attn/o_proj/kernel', 'heads_out'),
    (r'layers\.(\d+)\.attn\.(q|k|v)_bias', r'layers_\1/self_attn/\2_proj/bias', 'same'),
    (r'layers\.(\d+)\.mlp\.(gate|up|down)_proj\.kernel', r'layers_\1/mlp/\2_proj/kernel', 'same'),
)
_RESHAPES = {'same': lambda x: x,
             'in_heads': lambda x: x.reshape(x.shape[0], -1),      # [D, N, H] -> [D, N*H]
             'heads_out': lambda x: x.reshape(-1, x.shape[-1])}    # [N, H, D] -> [N*H, D]


def model_config(tunix_config, tokenizer, max_positions: int) -> ModelConfig:
  """This project's config of a tunix Qwen2 `ModelConfig`, in float32."""
  c = tunix_config
  return ModelConfig(
      architecture='Qwen2ForCausalLM', vocab_size=c.vocab_size, hidden_size=c.embed_dim,
      intermediate_size=c.hidden_dim, num_layers=c.num_layers, num_heads=c.num_heads,
      num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, max_position_embeddings=max_positions,
      rms_norm_eps=float(c.norm_eps), rope=RopeConfig(theta=float(c.rope_theta)),
      tie_word_embeddings=bool(c.use_tied_embedding), qkv_bias=True, o_bias=False,
      bos_token_id=tokenizer.bos_id(), eos_token_id=tokenizer.eos_id())


def _renamed(path: str) -> tuple[tuple, str]:
  for pattern, target, reshape in _QWEN2_RULES:
    if re.fullmatch(pattern, path):
      return tuple(re.sub(pattern, target, path).split('/')), reshape
  raise ValueError(f'tunix parameter {path!r} has no counterpart in this project\'s Qwen2 '
                   '(SpecRollRollout maps tunix Qwen2 models)')


@functools.cache
def _converter(plan: tuple):
  """One compiled conversion per parameter layout ((tunix path, our path, reshape), ...)."""
  # The engine runs on this process's first device; from tunix's mesh that is a
  # device-to-device copy, which tunix's transfer guard allows.
  return jax.jit(lambda values: {ours: _RESHAPES[reshape](values[theirs])
                                 for theirs, ours, reshape in plan},
                 out_shardings=jax.sharding.SingleDeviceSharding(jax.devices()[0]))


def params_from_nnx(state) -> dict:
  """This project's params from a tunix Qwen2 `nnx.Param` state: renames and reshapes, jitted,
  so device arrays stay on device (tunix syncs weights under a transfer guard)."""
  flat = {'.'.join(str(k) for k in key): value
          for key, value in traverse_util.flatten_dict(nnx.to_pure_dict(state)).items()}
  plan = tuple(sorted((path, *_renamed(path)) for path in flat))
  return traverse_util.unflatten_dict(_converter(plan)(flat))


def group_runs(prompts, group_size: int | None) -> tuple[list[str], int]:
  """The distinct prompts of a batch whose prompts come in adjacent runs of G copies, and G."""
  prompts = list(prompts)
  if not prompts:
    raise ValueError('SpecRollRollout.generate: no prompts')
  size = group_size or next((i for i, p in enumerate(prompts) if p != prompts[0]), len(prompts))
  runs = [prompts[i:i + size] for i in range(0, len(prompts), size)]
  broken = next((i for i, run in enumerate(runs)
                 if len(run) != size or any(p != run[0] for p in run)), None)
  if broken is not None:
    raise ValueError(f'SpecRollRollout.generate: prompts must come in adjacent runs of '
                     f'{size} copies (tunix repeats each prompt num_generations times); rows '
                     f'{broken * size}-{broken * size + size - 1} are not one prompt repeated')
  return [run[0] for run in runs], size


@dataclasses.dataclass(frozen=True)
class EngineSettings:
  """How SpecRollRollout builds its engine (the rest comes from tunix's RolloutConfig)."""
  engine: str = 'specroll'       # or 'vanilla': the same tokens, for comparison
  proposers: str = 'group'       # group drafts need no trained drafter; see speculative.factory
  max_nodes: int = 16            # tree nodes per row, root included
  capacity_tokens: int = 64      # C_hw: tokens one verification forward takes
  max_batch: int = 64            # rows of one compiled bucket
  group_size: int | None = None  # G; None: the length of the first run of equal prompts

  def __post_init__(self):
    if self.engine not in ENGINES:
      raise ValueError(f'engine must be one of {ENGINES}, got {self.engine!r}')
    if self.engine == 'specroll' and learned_kind_name(parse_proposers(self.proposers)):
      raise ValueError('SpecRollRollout drafts with group drafts (proposers="group"): heads '
                       'and the drafter need a warm start on the policy, which tunix does not '
                       'give an engine')


class SpecRollRollout(base_rollout.BaseRollout):
  """A tunix rollout engine running this project's vanilla or exact speculative engine."""

  def __init__(self, rollout_actor=None, tokenizer=None, mesh=None,
               rollout_config: base_rollout.RolloutConfig | None = None, **settings):
    del mesh  # rows run on this process's default device; see notes/history.md, issue 32
    if rollout_actor is None or type(rollout_actor).__name__ != 'Qwen2':
      raise ValueError('SpecRollRollout maps tunix Qwen2 models; got '
                       f'{type(rollout_actor).__name__}')
    if rollout_config is None:
      raise ValueError('SpecRollRollout needs the cluster\'s train rollout_config')
    self.settings = EngineSettings(**settings)
    # RLCluster hands over its TokenizerAdapter; a tokenizer given directly gets one too.
    self._tokenizer = (tokenizer if isinstance(tokenizer, TokenizerAdapter) else
                       TokenizerAdapter(tokenizer))
    self.max_prompt_length = rollout_config.max_prompt_length
    # The learner's log-probs (get_per_token_logps) are at the training sampler's temperature.
    self.temperature = rollout_config.temperature or 1.0
    self.config = model_config(rollout_actor.config, self._tokenizer, self._max_positions(
        rollout_config))
    self.params = params_from_nnx(nnx.state(rollout_actor, nnx.Param))
    seed = rollout_config.seed
    self.base_seed = 0 if seed is None else int(np.asarray(seed))
    self.calls = 0
    self._drivers = {}

  def _max_positions(self, rollout_config) -> int:
    return self.max_prompt_length + rollout_config.max_tokens_to_generate

  def _driver(self, rollout_config) -> Driver:
    """One engine and driver per sampler and length (train and eval may differ), built once."""
    if rollout_config.max_prompt_length != self.max_prompt_length:
      raise ValueError(f'rollout_config.max_prompt_length={rollout_config.max_prompt_length}, '
                       f'but this engine was built for {self.max_prompt_length}')
    eos = rollout_config.eos_tokens
    if eos is not None and list(eos) != [self.config.eos_token_id]:
      raise ValueError(f'rollout_config.eos_tokens={eos}: SpecRollRollout stops on the '
                       f'tokenizer\'s one EOS id {self.config.eos_token_id}')
    sampler = SamplerConfig(temperature=rollout_config.temperature,
                            top_k=max(rollout_config.top_k or 0, 0),
                            top_p=1.0 if rollout_config.top_p is None else rollout_config.top_p)
    key = (sampler, rollout_config.max_tokens_to_generate)
    if key not in self._drivers:
      config = dataclasses.replace(self.config,
                                   max_position_embeddings=self._max_positions(rollout_config))
      policy = Policy(config, self.params, self._tokenizer)
      s = self.settings
      proposer = tree = None
      if s.engine == 'specroll':
        proposer = with_group_drafts(None, parse_proposers(s.proposers), GroupDraftConfig())
        tree = TreeConfig(max_nodes=s.max_nodes, capacity_tokens=s.capacity_tokens)
      engine = build_engine(policy, s.engine, sampler, proposer=proposer, tree=tree)
      self._drivers[key] = Driver(engine, RolloutConfig(
          rollout_config.max_tokens_to_generate, max_batch=s.max_batch,
          prompt_bucket_min=self.max_prompt_length))
    return self._drivers[key]

  def generate(self, prompts, rollout_config: base_rollout.RolloutConfig, **kwargs):
    distinct, group_size = group_runs(prompts, self.settings.group_size)
    ids = [self._tokenizer.encode(p) for p in distinct]
    for i, prompt in enumerate(ids):
      if len(prompt) > self.max_prompt_length:
        raise ValueError(f'prompt {i * group_size} has {len(prompt)} tokens, more than '
                         f'rollout_config.max_prompt_length={self.max_prompt_length}')
    driver = self._driver(rollout_config)
    # tunix passes the same seed on every call: each call draws with its own.
    seed = self.base_seed * 1_000_003 + self.calls
    self.calls += 1
    responses = driver.generate(driver.engine.params(self.params, None), ids, group_size, seed)
    # tunix's sampler stops before the EOS: its GRPO loss never scores it.
    tokens = [np.asarray(r.token_ids[:-1] if r.finish_reason == FINISH_EOS else r.token_ids,
                         np.int32) for r in responses]
    padded_prompts = np.full((len(responses), self.max_prompt_length), self.pad_id(), np.int32)
    for row, r in enumerate(responses):
      prompt = ids[r.prompt_index]
      padded_prompts[row, self.max_prompt_length - len(prompt):] = prompt
    logprobs = None
    if rollout_config.return_logprobs:
      logprobs = [np.asarray(r.logprobs[:len(t)], np.float32) for r, t in zip(responses, tokens)]
    return base_rollout.RolloutOutput(
        text=[self._tokenizer.decode(t.tolist()) for t in tokens], logits=None, tokens=tokens,
        left_padded_prompt_tokens=padded_prompts, logprobs=logprobs)

  def get_per_token_logps(self, prompt_tokens, completion_tokens, completion_mask=None):
    """log pi(completion token | prompt, earlier tokens) [B, C] under the current params at the
    training temperature; 0 on padding (tokens equal to pad_id, as tunix masks them)."""
    del completion_mask  # tunix's mask is `completion != pad_id`, which this recomputes
    prompts, completions = np.asarray(prompt_tokens), np.asarray(completion_tokens)
    pad = self.pad_id()
    kept = [(p[p != pad], c[c != pad]) for p, c in zip(prompts, completions)]
    width = prompts.shape[1] + completions.shape[1]
    tokens = np.full((len(kept), width), -1, np.int32)
    for row, (p, c) in enumerate(kept):
      tokens[row, :len(p) + len(c)] = np.concatenate([p, c])
    logp = np.asarray(token_logprobs(self.config, self.params, jnp.asarray(tokens),
                                     self.temperature))
    out = np.zeros(completions.shape, np.float32)
    for row, (p, c) in enumerate(kept):
      out[row, :len(c)] = logp[row, len(p):len(p) + len(c)]
    return jnp.asarray(out)

  def update_params(self, params, filter_types=None) -> None:
    if filter_types is not None and any(t is nnx.LoRAParam for t in filter_types):
      raise ValueError('SpecRollRollout.update_params got LoRA parameters only: the engine '
                       'samples merged weights and cannot merge tunix\'s LoRA adapters; '
                       'train without LoRA to use it')
    new = params_from_nnx(params)
    expected = traverse_util.flatten_dict(self.params)
    got = traverse_util.flatten_dict(new)
    for key, value in expected.items():
      if key not in got:
        raise ValueError(f'update_params: the state has no {"/".join(key)}')
      if got[key].shape != value.shape:
        raise ValueError(f'update_params: {"/".join(key)} has shape {got[key].shape}, '
                         f'the engine holds {value.shape}')
    self.params = new

  def pad_id(self) -> int:
    return self._tokenizer.pad_id()

  def eos_id(self) -> int:
    return self._tokenizer.eos_id()

  def model(self):
    """None: tunix then syncs the actor's weights into this engine after every global step."""
    return None
