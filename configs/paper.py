"""The paper's settings for real models: --config=configs/paper.py:MODEL,DATASET

  python -m experiments.train_grpo --config=configs/paper.py:qwen2.5-7b,gsm8k \
      --config.policy.checkpoint=/path/to/Qwen2.5-7B-Instruct --workdir=runs/qwen7b_gsm8k

MODEL in MODELS (the checkpoint is the user's own HF directory: nothing is downloaded),
DATASET in DATASETS (read from --config.task.data_dir, $SPECROLL_DATA_DIR or
../shared/data). Settings follow common GRPO practice for these sizes (group 8, lr 1e-6, k3 KL 1e-3, bf16); DAPO uses the
clip-higher range it was published with. The mesh is FSDP over every device
(--config.mesh.fsdp / .tensor / .data to change it); `experiments.measure.memory_report` says what
each device then holds, from ARCHITECTURES when the checkpoint is not at hand. LoRA as
FastGRPO trains 7B policies: --config.grpo.lora_rank=64 --config.grpo.lora_alpha=32.
"""
from configs.tiny_math import get_config as base_config

MODELS = {
    'qwen2.5-1.5b': dict(prompts_per_step=128, micro_batch_size=16, max_batch=256),
    'qwen2.5-7b': dict(prompts_per_step=128, micro_batch_size=8, max_batch=256),
    'llama3.1-8b': dict(prompts_per_step=128, micro_batch_size=8, max_batch=256),
}
# The models' published config.json fields that shape memory (for experiments.measure.memory_report).
ARCHITECTURES = {
    'qwen2.5-1.5b': dict(architectures=['Qwen2ForCausalLM'], vocab_size=151936,
                         hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2,
                         max_position_embeddings=32768, rope_theta=1e6,
                         tie_word_embeddings=True),
    'qwen2.5-7b': dict(architectures=['Qwen2ForCausalLM'], vocab_size=152064, hidden_size=3584,
                       intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, max_position_embeddings=32768, rope_theta=1e6,
                       tie_word_embeddings=False),
    'llama3.1-8b': dict(architectures=['LlamaForCausalLM'], vocab_size=128256,
                        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                        num_attention_heads=32, num_key_value_heads=8,
                        max_position_embeddings=131072, rms_norm_eps=1e-5,
                        rope_scaling=dict(rope_type='llama3', factor=8.0, low_freq_factor=1.0,
                                          high_freq_factor=4.0,
                                          original_max_position_embeddings=8192),
                        rope_theta=5e5, tie_word_embeddings=False),
}
DATASETS = {
    'gsm8k': dict(source='gsm8k', max_new_tokens=1024, clip_high=0.2),
    'math': dict(source='math', max_new_tokens=2048, clip_high=0.2),
    'dapo': dict(source='dapo', max_new_tokens=4096, clip_high=0.28),
}


def get_config(arg: str = 'qwen2.5-1.5b,gsm8k'):
  model, dataset = arg.split(',')
  if model not in MODELS or dataset not in DATASETS:
    raise ValueError(f'configs/paper.py:{arg}: choose MODEL from {sorted(MODELS)} and '
                     f'DATASET from {sorted(DATASETS)}')
  m, d = MODELS[model], DATASETS[dataset]
  c = base_config()
  c.steps = 300
  c.checkpoint_every = 10
  c.policy.checkpoint = f'/path/to/{model}'  # required: the user's HF directory
  c.policy.dtype = 'bfloat16'
  c.task.source, c.task.split = d['source'], ''
  c.rollout.prompts_per_step = m['prompts_per_step']
  c.rollout.driver.update(max_new_tokens=d['max_new_tokens'], max_batch=m['max_batch'])
  c.mesh.update(data=1, fsdp=-1, tensor=1)
  c.audit.every = 20  # a vanilla replay of every 20th rollout: ~5% more rollout time
  c.heads.update(num_sequences=2048, held_out=128, steps=2000)
  c.grpo.update(learning_rate=1e-6, kl_coef=1e-3, clip_epsilon_high=d['clip_high'],
                micro_batch_size=m['micro_batch_size'])
  return c
