"""Multi-adapter LoRA ops: Triton kernels for CUDA; on CPU the fixed-tile path of ``cpu_lora``;
``reference`` (pure torch) is the test oracle. ``lora_backend`` picks by device."""
