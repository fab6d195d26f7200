"""The static shapes a rollout compiles: batch buckets and prompt (cache) widths."""


def pow2_at_least(n: int, minimum: int) -> int:
  size = minimum
  while size < n:
    size *= 2
  return size


def batch_buckets(max_batch: int, data_size: int) -> list[int]:
  """Smallest first; every bucket is a multiple of the data axis so rows shard evenly."""
  if max_batch % data_size:
    raise ValueError(f'max_batch={max_batch} must be a multiple of the data axis ({data_size})')
  buckets, size = [], data_size
  while size < max_batch:
    buckets.append(size)
    size *= 2
  return buckets + [max_batch]


def sequence_width(longest_prompt: int, max_new_tokens: int, prompt_bucket_min: int) -> int:
  """Slots a row needs: its prompt bucket (a power of two, so prompt lengths share few
  compiled shapes) plus every token it may generate. The rollout's KV cache and the
  learner's batch both use it, so a response always fits the batch it is trained in."""
  return pow2_at_least(longest_prompt, prompt_bucket_min) + max_new_tokens
