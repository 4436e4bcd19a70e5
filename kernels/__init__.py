"""Multi-adapter LoRA ops and paged attention: Triton kernels for CUDA; on CPU the fixed-tile LoRA path
of ``cpu_lora``; ``reference`` (pure torch) is the test oracle. ``lora_backend`` picks by device;
``paged_attention`` is the attention kernels' one entry."""
