"""The static shapes a rollout compiles: batch buckets and prompt (cache) widths."""


def pow2_at_least(n: int, minimum: int) -> int:
  size = minimum
  while size < n:
    size *= 2
  return size


def batch_buckets(max_batch: int, row_shards: int) -> list[int]:
  """Smallest first; every bucket is a multiple of the mesh's row shards so rows split evenly."""
  if max_batch % row_shards:
    raise ValueError(f'max_batch={max_batch} must be a multiple of the mesh\'s row shards '
                     f'(data x fsdp = {row_shards})')
  buckets, size = [], row_shards
  while size < max_batch:
    buckets.append(size)
    size *= 2
  return buckets + [max_batch]


def prompt_bucket(longest_prompt: int, prompt_bucket_min: int, buckets_per_octave: int) -> int:
  """The smallest of `buckets_per_octave` evenly spaced widths in each octave
  [m * 2^k, m * 2^(k+1)) that holds the prompt. One per octave (powers of two) compiles the
  fewest shapes; four pad at most 25% (a 169-token prompt gets 192 slots, not 256)."""
  if buckets_per_octave < 1 or prompt_bucket_min % buckets_per_octave:
    raise ValueError(f'buckets_per_octave={buckets_per_octave} must be >= 1 and divide '
                     f'prompt_bucket_min={prompt_bucket_min}')
  if longest_prompt <= prompt_bucket_min:
    return prompt_bucket_min
  octave_start = pow2_at_least(longest_prompt, prompt_bucket_min) // 2
  step = octave_start // buckets_per_octave
  return -(-longest_prompt // step) * step


def sequence_width(longest_prompt: int, max_new_tokens: int, prompt_bucket_min: int,
                   buckets_per_octave: int) -> int:
  """Slots a row needs: its prompt bucket (few widths, so prompt lengths share few compiled
  shapes) plus every token it may generate. The rollout's KV cache and the learner's batch
  both use it, so a response always fits the batch it is trained in."""
  return prompt_bucket(longest_prompt, prompt_bucket_min, buckets_per_octave) + max_new_tokens
