"""Multi-adapter LoRA ops: Triton kernels for CUDA, and ``reference`` (pure torch) for CPU
and as the test oracle. ``lora_ops`` picks between them by device."""
