"""The device side: the model runner, the KV cache, step buckets, compiled-step cache."""
