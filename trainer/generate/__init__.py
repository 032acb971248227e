"""`python -m trainer.generate RUN_OR_CHECKPOINT`: talk to a trained model.

RUN_OR_CHECKPOINT is a run directory (its newest committed checkpoint), a
`checkpoints/step_<N>` folder, or a `python -m trainer.export` folder. The model is built through
its family (trainer/models/families/) and its weights read straight from the sharded DCP
checkpoint in this one process: no export step, no process group. The text goes through the
run's own tokenizer (data.tokenizer, or model.path for model=hf; bytes for data=bytes) and, for
`--chat`, its chat template.

    load.py    what a folder holds: the model and its tokenizer
    decode.py  greedy or sampled next tokens, streamed as text
    cli.py     the command line
"""
