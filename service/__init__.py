"""The scheduler process: requests, tokenizer, queue, KV accounting, batch planning, streaming."""
