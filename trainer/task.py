"""What the model is trained to do: next-token prediction (llama, hf) or image classification (vit).

The loop, the planner's meta trace and the pre-flight report ask the task for its loss, an
example micro-batch, its datasets and how many tokens a sample is (for throughput and MFU); none
of them needs to know which kind of model it trains. Importing this module does not import
torch (the pre-flight checks and the report stay fast to refuse a bad command line).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from trainer.config import IMAGE_ARCHS, CheckpointingConfig, DataConfig, ModelConfig
from trainer.validate import DOCUMENT_SOURCES, IMAGE_SOURCES

IGNORE_INDEX = -100  # a target the loss skips (torch's cross_entropy default)

if TYPE_CHECKING:
    import torch
    from torch import nn

    Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Task:
    kind: str  # "lm" | "classification"
    sample_shape: tuple[int, ...]  # one input: (seq_len,) tokens or (channels, size, size)
    tokens_per_sample: int  # sequence length, or patch tokens per image
    criterion: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (logits, targets) -> loss
    # Packed documents (data=text / chat): the loss is a sum over the supervised targets, which
    # the step divides by the global batch's count (micro-batches hold different numbers).
    summed: bool = False
    # checkpointing.head=chunked: the model makes its summed loss itself through the fused
    # chunked head, this many tokens at a time (None: logits, then the criterion).
    head_chunk: int | None = None

    def loss(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
             positions: torch.Tensor | None = None) -> torch.Tensor:
        if self.head_chunk is not None:
            total = model(inputs, positions=positions, targets=targets,
                          chunk_tokens=self.head_chunk)
            return total if self.summed else total / (targets != IGNORE_INDEX).sum().clamp(min=1)
        if positions is None:
            return self.criterion(model(inputs), targets)
        return self.criterion(model(inputs, positions=positions), targets)

    def example(self, micro_batch_size: int, device: torch.device | str = "meta") -> Batch:
        """A micro-batch of the right shapes and dtypes (zeros; on meta for tracing)."""
        import torch

        if self.kind == "lm":
            tokens = torch.zeros(micro_batch_size, *self.sample_shape, dtype=torch.long,
                                 device=device)
            return tokens, tokens
        return (torch.zeros(micro_batch_size, *self.sample_shape, device=device),
                torch.zeros(micro_batch_size, dtype=torch.long, device=device))

    def eval_batch(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                   positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean loss, fraction of correct top-1 predictions) of one batch; for a summed loss,
        (loss summed over the supervised targets, their count)."""
        if self.head_chunk is not None:  # no logits: the loss, and the targets it averages
            loss = self.loss(model, inputs, targets, positions)
            return loss, (targets != IGNORE_INDEX).sum().float()
        logits = model(inputs) if positions is None else model(inputs, positions=positions)
        if self.summed:
            return self.criterion(logits, targets), (targets != IGNORE_INDEX).sum().float()
        correct = (logits.argmax(dim=-1) == targets).float().mean()
        return self.criterion(logits, targets), correct


def head_chunk(model: ModelConfig, head: CheckpointingConfig) -> int | None:
    """Tokens per chunk of the fused chunked head (checkpointing.head=chunked), None for the
    plain head and for image models (whose head is a small classifier)."""
    if head.head != "chunked" or model.arch in IMAGE_ARCHS:
        return None
    if head.head_chunk_tokens is not None:
        return head.head_chunk_tokens
    from trainer.models.hf_settings import model_vocab_size

    # As checkpointing/head.py's default_chunk_tokens, without importing torch here.
    return max(1, head.head_budget_mib * 2**20 // (model_vocab_size(model) * 4))


def task_for(model: ModelConfig, data: DataConfig, head_chunk_tokens: int | None = None) -> Task:
    if model.arch in IMAGE_ARCHS:
        from trainer.models.vit import class_loss

        side = model.image_size // model.patch_size
        return Task("classification", (model.channels, model.image_size, model.image_size),
                    side * side, class_loss)
    from trainer.models.llama import next_token_loss, next_token_loss_sum

    if data.source in DOCUMENT_SOURCES:
        return Task("lm", (data.seq_len,), data.seq_len, next_token_loss_sum, summed=True,
                    head_chunk=head_chunk_tokens)
    return Task("lm", (data.seq_len,), data.seq_len, next_token_loss,
                head_chunk=head_chunk_tokens)


def build_task_datasets(model: ModelConfig, data: DataConfig, vocab_size: int, seed: int,
                        preparer: bool = True, share: tuple[int, int, int, int] = (0, 1, 1, 1)):
    """(train, val) datasets for the task: token windows, packed documents, or labelled images.
    preparer: this process tokenizes documents not cached yet (one per node); others wait.
    share: (rank, world, micro-batch, accumulation), what a streamed corpus needs."""
    if data.source in DOCUMENT_SOURCES:
        from trainer.data.documents import text_datasets
        from trainer.data.sources import document_settings

        return text_datasets(data.path, data.val_path, data.tokenizer or model.path,
                             document_settings(data), data.cache_dir, vocab_size, preparer,
                             share if data.streaming else None)
    if data.source in IMAGE_SOURCES:
        from trainer.data.images import image_datasets

        preprocess = None
        if model.arch == "hf_vision":  # the pretrained model's own mean, std and resampling
            from trainer.models.hf_vision import preprocessing

            preprocess = preprocessing(model.path)
        elif model.arch == "timm":  # timm's pretrained config of the model: mean, std, interpolation
            from trainer.models.timm_vision import preprocessing as timm_preprocessing

            preprocess = timm_preprocessing(model.name, model.timm_args)
        return image_datasets(data.source, model.image_size, model.channels, model.num_classes,
                              seed, data.train_path, data.val_path, data.augment,
                              data.skip_bad_images, preprocess)
    from trainer.data.tokens import build_datasets

    train, val, _ = build_datasets(data.source, data.seq_len, vocab_size, seed, data.train_path,
                                   data.val_path, data.token_dtype, data.max_corpus_bytes)
    return train, val
