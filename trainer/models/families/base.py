"""What every model family answers, and the task it trains.

A family (trainer/models/families/<family>.py) is one object that knows everything the rest of the
trainer may ask about one kind of model: its settings (checked without torch), how it is built on
the meta device, its blocks, its attention, its task, head and loss, its FLOPs, its vocabulary, its
image preprocessing and how its weights are exported. Two bases hold what families of a kind
share: `LanguageModel` (next-token prediction, the plain or the fused chunked head) and
`ImageClassifier` (a class per image). Importing this module does not import torch: the model code
is imported inside the methods that need it.

Attention is the hook sequence parallelism uses. Every family's attention calls one function per
block, with one signature (trainer/models/attention.py):

    attend(q, k, v, **options) -> out    # q [B, heads, T, head_dim], k/v [B, kv_heads, T, head_dim]

`wrap_attention(model, wrap)` replaces each block's function by `wrap(current)`; `current` is what
the block called before (the model's own attention, or an earlier wrap), so a wrapper that calls it
gives the model's outputs bit for bit, and one that redistributes q, k and v first (Ulysses: tokens
for heads) changes only where attention runs.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Mapping, Optional

from checkpointing.plan import default_chunk_tokens
from trainer.config import CheckpointingConfig, ConfigError, ModelConfig, require

IGNORE_INDEX = -100  # a target the loss skips (torch's cross_entropy default)

if TYPE_CHECKING:
    import torch
    from torch import nn

    Batch = tuple[torch.Tensor, torch.Tensor]
    Attend = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class Task:
    """What the model is trained to do: its loss, an example micro-batch, and how many tokens a
    sample is (for throughput and MFU). The loop, the planner's meta trace and the pre-flight
    report ask the task; none of them needs to know which kind of model it trains."""

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
    # checkpointing.head_rows=supervised on a summed loss: the head runs on the supervised rows
    # only (checkpointing/head.py); on meta, the first `meta_fraction` of the rows stand for them.
    gather_rows: bool = False
    meta_fraction: float = 1.0

    @property
    def head_rows_per_sample(self) -> float:
        """Rows the output layer computes per sample: each token of a language model (its
        supervised share where the head runs on those rows only), one per image."""
        rows = self.tokens_per_sample if self.kind == "lm" else 1
        return rows * self.meta_fraction if self.gather_rows else rows

    def loss(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
             positions: torch.Tensor | None = None) -> torch.Tensor:
        rows = self._rows(targets)
        if rows is not None:  # a summed loss, from the head on the supervised rows
            return model(inputs, positions=positions, targets=targets,
                         chunk_tokens=self.head_chunk, rows=rows)
        if self.head_chunk is not None:
            total = model(inputs, positions=positions, targets=targets,
                          chunk_tokens=self.head_chunk)
            return total if self.summed else total / (targets != IGNORE_INDEX).sum().clamp(min=1)
        if positions is None:
            return self.criterion(model(inputs), targets)
        return self.criterion(model(inputs, positions=positions), targets)

    def _rows(self, targets: torch.Tensor) -> torch.Tensor | None:
        """The flat positions the head computes, or None for all of them."""
        if not self.gather_rows:
            return None
        from checkpointing.head import supervised_rows

        return supervised_rows(targets, IGNORE_INDEX, self.meta_fraction)

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
        if self.gather_rows:  # summed: from the supervised rows' logits only
            return (self.loss(model, inputs, targets, positions),
                    (targets != IGNORE_INDEX).sum().float())
        logits = model(inputs) if positions is None else model(inputs, positions=positions)
        if self.summed:
            return self.criterion(logits, targets), (targets != IGNORE_INDEX).sum().float()
        correct = (logits.argmax(dim=-1) == targets).float().mean()
        return self.criterion(logits, targets), correct

    def eval_metrics(self, loss: torch.Tensor, second: torch.Tensor, batches: torch.Tensor,
                     mean: Callable[[torch.Tensor], float]) -> dict[str, float]:
        """The validation figures from the weighted sums of eval_batch's two results on this
        rank over `batches` (full batches' worth: trainer/observe/evaluate.py); `mean` averages
        a value over the ranks (a collective: every rank calls it, in this order). val_loss; a
        classifier's val_accuracy (top-1) too: means over every rank's samples."""
        if self.summed:  # the mean over every rank's supervised targets
            return {"val_loss": mean(loss) / max(mean(second), 1e-30)}
        counted = max(mean(batches), 1e-30)  # ranks may score different numbers of samples
        metrics = {"val_loss": mean(loss) / counted}
        if self.kind == "classification":
            metrics["val_accuracy"] = mean(second) / counted
        return metrics


class Family:
    """The questions the trainer asks of a model family; a family module subclasses
    `LanguageModel` or `ImageClassifier` and answers the rest."""

    takes_lora = False  # whether model.lora applies (language models)

    arch = ""  # the model.arch value that chooses this family (conf/model/*.yaml)
    # What one sample is, for the data sources to check theirs against (trainer/data/):
    # "tokens" (a language model) or "images" (a classifier).
    sample = "tokens"
    vocab_key = "model.vocab_size"  # the key that sets its vocabulary, for error messages

    # Settings, checked without torch.
    def validate(self, m: ModelConfig, seq_len: int) -> None:
        """The family's own settings (its shapes, its files), and data.seq_len = `seq_len`
        against them; a mistake raises the ConfigError naming its key. Subclasses call the
        base of their kind first (ImageClassifier's checks the image settings)."""

    def check_deep(self, m: ModelConfig) -> None:
        """Checks that need the family's library (trainer/preflight/precheck.py, before the run)."""

    def vocab_size(self, m: ModelConfig) -> int:
        return m.vocab_size

    def own_tokenizer(self, m: ModelConfig) -> Optional[str]:
        """A folder holding the model's own tokenizer, when data.tokenizer may be left out."""
        return None

    # The model.
    def build_on_meta(self, m: ModelConfig) -> nn.Module:
        """The model, parameters on the meta device. Weights come at materialisation: its
        `init_param` draws them, or reads them from the pretrained files the settings name."""
        raise NotImplementedError

    def blocks(self, model: nn.Module, pattern: Optional[str]) -> list[tuple[str, nn.Module]]:
        """(name, module) of each repeated block, in forward order: the finder's, which sees
        any ModuleList of same-class children (pattern: model.block_pattern's glob)."""
        from checkpointing.blocks import find_blocks

        return find_blocks(model, pattern)

    def attention_modules(self, model: nn.Module) -> list[nn.Module]:
        """The modules whose attention `wrap_attention` reaches, in forward order."""
        raise NotImplementedError

    def wrap_attention(self, model: nn.Module, wrap: Callable[[Attend], Attend]) -> int:
        """Each attention module calls `wrap(current)` from now on (see the module docstring);
        returns how many modules were wrapped."""
        from trainer.models.attention import wrap_attend

        return wrap_attend(self.attention_modules(model), wrap)

    def mlp_modules(self, model: nn.Module, pattern: Optional[str] = None) -> list[nn.Module]:
        """Each block's token-wise MLP (`mlp_of`), in forward order, where it has one: what
        sequence tiles (checkpointing.tiles, checkpointing/tiles.py) compute in slices."""
        found = (self.mlp_of(block) for _, block in self.blocks(model, pattern))
        return [mlp for mlp in found if mlp is not None]

    def flops_per_token(self, m: ModelConfig, model: nn.Module, tokens_per_sample: int) -> float:
        """Training FLOPs per token (forward and backward), for MFU."""
        return model.flops_per_token(tokens_per_sample)

    # Sequence parallelism (sharding.sequence, trainer/models/sequence_parallel.py).
    def check_sequence(self, m: ModelConfig, degree: int) -> None:
        """Without torch (trainer/validate.py): refuse, with the ConfigError naming the key, a
        sequence degree > 1 this family's settings cannot split (its heads, its attention)."""
        raise ConfigError("sharding.sequence", f"model.arch={self.arch} has no sequence "
                          "parallelism (llama and hf have); set sharding.sequence=1")

    def check_sequence_parallel(self, m: ModelConfig, degree: int = 1) -> None:
        """With torch, on the meta model (trainer/preflight/precheck.py): what the settings
        alone cannot tell. Refuses with the ConfigError naming the key."""
        self.check_sequence(m, degree)

    def sequence_parallel(self, model: nn.Module, group: Optional[torch.distributed.ProcessGroup],
                          context_group: Optional[torch.distributed.ProcessGroup] = None) -> int:
        """Make `model` run sequence-parallel over `group` (Ulysses) and `context_group` (the
        ring; None: none); returns the attention modules wrapped. Once per model, before or
        after FSDP; see the subclass for its contract."""
        raise NotImplementedError(f"model.arch={self.arch} has no sequence parallelism")

    # Ring attention (sharding.context, sharding/ring.py).
    def ring_options(self) -> Optional[Callable[[dict], tuple]]:
        """How the ring reads this family's attention keyword arguments (document ids, scale,
        dropout; trainer/models/sequence_parallel.py's ring_wrap); None: the built-in's."""
        return None

    def wrap_ring(self, model: nn.Module, group_or_exchange) -> int:
        """Every attention of `model` through the ring over a process group (sequence_parallel)
        or the meta trace's MetaRingExchange (trainer/preflight/scenario.py), one code path
        for both; wrap Ulysses around it after. Returns the attention modules wrapped."""
        from trainer.models.sequence_parallel import llama_ring_options, ring_wrap

        return self.wrap_attention(model, ring_wrap(group_or_exchange,
                                                    self.ring_options() or llama_ring_options))

    def check_context(self, m: ModelConfig, context: int, compiled: bool = False) -> None:
        """Without torch (trainer/validate.py): refuse, naming the key, a context degree > 1
        this family's model or attention cannot run through the ring."""
        raise ConfigError("sharding.context", f"model.arch={self.arch} has no ring attention "
                          "(llama and qwen3 have); set sharding.context=1")

    def ulysses_options(self) -> Optional[Callable[[dict, int, int, int], dict]]:
        """How this family's attention keyword arguments change under Ulysses (see
        trainer/models/sequence_parallel.py's ulysses_wrap); None: they pass through."""
        return None

    def wrap_ulysses(self, model: nn.Module, exchange) -> int:
        """Every attention of `model` through Ulysses' all-to-alls over `exchange`: the real
        one (sequence_parallel) or the meta trace's (trainer/preflight/scenario.py), one code
        path for both. Returns the attention modules wrapped."""
        from trainer.models.sequence_parallel import ulysses_wrap

        return self.wrap_attention(model, ulysses_wrap(exchange, self.ulysses_options()))

    # Sequence tiles (checkpointing.tiles, checkpointing/tiles.py).
    tileable = False  # its blocks have token-wise parts that tile_block tiles

    def mlp_of(self, block: nn.Module) -> Optional[nn.Module]:
        """The token-wise MLP of one block, which sequence tiles compute a slice at a time
        (called with one [batch, tokens, dim] tensor); None: the block has none."""
        return None

    def tile_block(self, block: nn.Module, tiles: int) -> bool:
        """Make one block compute its token-wise parts in `tiles` sequence tiles; False: it
        has none. Here (HF and the rest): the MLP alone (`mlp_of`), its norm outside the tiles;
        the built-in Llama tiles more (families/llama.py)."""
        from checkpointing.tiles import tile_module

        mlp = self.mlp_of(block)
        if mlp is None:
            return False
        tile_module(mlp, tiles)
        return True

    def tile_head(self, model: nn.Module, tiles: int) -> None:
        """The part before the head that tiles as the blocks do (the built-in Llama's final
        norm); nothing here."""

    # Task, head and loss.
    def task(self, m: ModelConfig, seq_len: int, summed: bool,
             head: CheckpointingConfig) -> Task:
        raise NotImplementedError

    def check_head(self, m: ModelConfig, head: CheckpointingConfig) -> None:
        """checkpointing.head=chunked (trainer/preflight/precheck.py): refuse, naming the key,
        what the fused chunked head cannot do for this model. Here nothing: a model without
        the chunked head keeps its own (image classifiers: small) head."""

    def image_preprocessing(self, m: ModelConfig) -> Optional[dict]:
        """The pretrained model's own image_mean, image_std and resample (None: the defaults
        of trainer/data/images.py)."""
        return None

    def context_length(self, m: ModelConfig, model: nn.Module) -> Optional[int]:
        """The longest token sequence the built `model` reads (trainer.generate's bound; None:
        the model sets none); a family whose models generate no text refuses, naming
        model.arch."""
        raise ConfigError("model.arch", f"model.arch={self.arch} generates no text; "
                          "trainer.generate needs a language model")

    # Weights out.
    def export(self, tensors: Mapping[str, torch.Tensor], model: Mapping, out: str, step: int,
               checkpoint: str) -> str:
        """Write the trained weights to `out` for inference (`python -m trainer.export`):
        here one model.safetensors named as in the model, and config.json saying what it is.
        `model` is the checkpoint's model section, as a mapping."""
        from safetensors.torch import save_file

        os.makedirs(out, exist_ok=True)
        save_file(dict(tensors), os.path.join(out, "model.safetensors"),
                  metadata={"format": "pt", "step": str(step)})
        config = {"model": dict(model), "step": step, "checkpoint": os.path.abspath(checkpoint),
                  "parameters": int(sum(t.numel() for t in tensors.values()))}
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(config, f, indent=1, sort_keys=True)
        return out


class LanguageModel(Family):
    """Next-token prediction over data.seq_len tokens, with the plain head (logits, then
    cross-entropy) or the fused chunked head (checkpointing.head=chunked)."""

    sample = "tokens"
    takes_lora = True  # model.lora adapts its blocks' linear layers (families/lora.py)

    def context_length(self, m: ModelConfig, model: nn.Module) -> Optional[int]:
        return m.max_seq_len

    def adapter_tensor(self, name: str, tensor: torch.Tensor,
                       model: Mapping) -> tuple[str, torch.Tensor]:
        """A LoRA tensor's name (`<layer>.lora_A.weight`) and value as PEFT's adapter file
        holds it for this family's transformers export; `name` is the layer's as the model
        names it, with the adapter's part (families/lora.py's export_adapter)."""
        raise NotImplementedError(f"{self.arch}: no transformers export to adapt")

    def head_chunk(self, m: ModelConfig, head: CheckpointingConfig) -> Optional[int]:
        """Tokens per chunk of the fused chunked head; None for the plain head."""
        if head.head != "chunked":
            return None
        if head.head_chunk_tokens is not None:
            return head.head_chunk_tokens
        return default_chunk_tokens(self.vocab_size(m), head.head_budget_mib * 2**20)

    def task(self, m: ModelConfig, seq_len: int, summed: bool,
             head: CheckpointingConfig) -> Task:
        from trainer.models.llama import next_token_loss, next_token_loss_sum

        criterion = next_token_loss_sum if summed else next_token_loss
        # Only packed documents (a summed loss) have targets that are not learned.
        gather = summed and head.head_rows == "supervised"
        return Task("lm", (seq_len,), seq_len, criterion, summed=summed,
                    head_chunk=self.head_chunk(m, head), gather_rows=gather,
                    meta_fraction=head.head_supervised_fraction or 1.0)

    def check_head(self, m: ModelConfig, head: CheckpointingConfig) -> None:
        """The chunk's fp32 logits fit checkpointing.head_budget_mib, and the model's logits
        are hidden @ W.T (check_fused_head) so the fused head gives them."""
        vocab, budget = self.vocab_size(m), head.head_budget_mib * 2**20
        tokens = head.head_chunk_tokens or 1
        if tokens * vocab * 4 > budget:
            what = (f"checkpointing.head_chunk_tokens={head.head_chunk_tokens} tokens" if
                    head.head_chunk_tokens else "one token")
            raise ConfigError("checkpointing.head_budget_mib", f"{what} of a {vocab:,}-word "
                              f"vocabulary is {tokens * vocab * 4 / 2**20:.1f} MiB of fp32 "
                              f"logits, over the budget of {head.head_budget_mib} MiB: raise "
                              "it, or lower checkpointing.head_chunk_tokens")
        self.check_fused_head(m)

    def check_fused_head(self, m: ModelConfig) -> None:
        """Refuse a model whose logits are not hidden @ W.T (bias, scale, soft-capping)."""


class ImageClassifier(Family):
    """A class per square image of model.image_size pixels, seen as patch tokens; the head is a
    small classifier, always plain."""

    sample = "images"

    def validate(self, m: ModelConfig, seq_len: int) -> None:
        """What every image classifier needs: positive sizes, a patch that divides the image,
        grey or RGB (data.seq_len does not apply: a sample is an image)."""
        for key in ("image_size", "patch_size", "num_classes"):
            value = getattr(m, key)
            require(value > 0, f"model.{key}", f"must be a positive integer, got {value}")
        require(m.image_size % m.patch_size == 0, "model.patch_size",
                f"must divide model.image_size={m.image_size}, got {m.patch_size}")
        require(m.channels in (1, 3), "model.channels", f"1 (grey) or 3 (RGB), got {m.channels}")

    def task(self, m: ModelConfig, seq_len: int, summed: bool,
             head: CheckpointingConfig) -> Task:
        from trainer.models.vit import class_loss

        side = m.image_size // m.patch_size
        return Task("classification", (m.channels, m.image_size, m.image_size), side * side,
                    class_loss)
