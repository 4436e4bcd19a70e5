"""The continuous-batching engine: schedule() -> run() -> postprocess(), over a paged KV cache."""
