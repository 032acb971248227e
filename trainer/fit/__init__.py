"""Will it fit, and fitting it: the pre-flight memory report, scenarios, advice, the memory
picture, `checkpointing=auto` / `micro_batch_size=auto`, and checks run before the run starts."""
