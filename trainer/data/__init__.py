"""What the model reads. One source object per kind of data (token windows, documents prepared
or streamed, images: base.py, factory.py and the *_source.py modules) checks its own settings
and opens the one `Data` the Trainer holds (batches.py); below them the token files and the
sampler, documents, chat templates and packing, image folders, reading ahead, and the tokenize
command. One global order of samples whatever the world size."""
