"""Multi-adapter LoRA ops: Triton kernels for CUDA; on CPU the paths of ``cpu_lora`` and
``reference`` (pure torch, also the test oracle). ``lora_backend`` picks between them, on CPU by the
measurements of ``cpu_tuner``."""
