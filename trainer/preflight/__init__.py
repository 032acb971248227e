"""Before the run: will it fit, and sizing it. The pre-flight memory report's tables
(`tables`), scenarios, advice and picture (`scenario`, `advice`, `timeline`, `plot`);
`checkpointing=auto` / `micro_batch_size=auto` (`auto_plan` decides, `auto_run` is the trainer's
side: device timing, one decision for all ranks); and the checks that need torch or the files
(`precheck`). The command line is trainer/report.py (`python -m trainer.report`)."""
