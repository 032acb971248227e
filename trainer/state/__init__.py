"""What a run leaves on disk and gets back: checkpoints committed atomically and when to save them
(the save schedule), resume and rollback, the run directory's name and owner, plan files, and
export for inference."""
