"""What the model reads: token files and windows, image folders, the tokenize command, and
reading the next batches ahead. One global order of samples whatever the world size."""
