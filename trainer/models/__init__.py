"""The models blocktrain trains: built-in Llama and ViT, Hugging Face causal LMs and image
classifiers, timm image classifiers, and reading pretrained weights one tensor at a time; in
`families/`, one object per `model.arch` that the rest of the trainer asks about its models.
Models know nothing of the run: no data, state, report or loop is imported here."""
