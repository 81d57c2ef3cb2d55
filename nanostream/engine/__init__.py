"""The inference engine: sequences, KV blocks, scheduling, the model runner and the step loop."""
