"""Multi-adapter LoRA ops and paged attention: Triton kernels for CUDA; on CPU the paths of ``cpu_lora``
and ``reference`` (pure torch, also the test oracle). ``lora_backend`` picks between the LoRA paths, on
CPU by the measurements of ``cpu_tuner``; ``paged_attention`` is the attention kernels' one entry."""
