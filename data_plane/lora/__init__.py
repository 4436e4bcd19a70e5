"""LoRA adapters in the data plane: PEFT loading, slot-buffer layers, two-tier caches."""
