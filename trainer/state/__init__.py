"""What a run leaves on disk and gets back: checkpoints committed atomically, resume and rollback,
the run directory's name and owner, plan files, and export for inference."""
