"""The built-in Llama (`model.arch=llama`, trainer/models/llama.py): a decoder-only language model
whose shapes are the model.* fields, initialised from its own seeded rules, exported as a folder
transformers' LlamaForCausalLM loads."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Mapping, Optional

from trainer.config import ConfigError, ModelConfig, require
from trainer.models.families.base import LanguageModel

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed import ProcessGroup

    from trainer.models.llama import LlamaArgs


def llama_args(m: ModelConfig) -> LlamaArgs:
    from trainer.models.llama import LlamaArgs

    return LlamaArgs(dim=m.dim, n_layers=m.n_layers, n_heads=m.n_heads,
                     n_kv_heads=m.n_kv_heads, vocab_size=m.vocab_size,
                     ffn_hidden=m.ffn_hidden, max_seq_len=m.max_seq_len,
                     norm_eps=m.norm_eps, rope_theta=m.rope_theta, dropout=m.dropout,
                     tie_embeddings=m.tie_embeddings, head_width=m.head_dim)


class Llama(LanguageModel):
    arch = "llama"

    def validate(self, m: ModelConfig, seq_len: int) -> None:
        """Heads that split model.dim (or model.head_dim set), an even head size (rotary
        turns pairs of features), KV heads grouping the heads, and data.seq_len within
        model.max_seq_len."""
        if m.head_dim is None:
            require(m.dim % m.n_heads == 0, "model.n_heads",
                    f"must divide model.dim={m.dim}, got {m.n_heads}")
            require((m.dim // m.n_heads) % 2 == 0, "model.n_heads",
                    f"head size model.dim/model.n_heads={m.dim // m.n_heads} must be even "
                    "(rotary)")
        else:
            require(m.head_dim > 0 and m.head_dim % 2 == 0, "model.head_dim",
                    f"must be null (model.dim/model.n_heads) or a positive even size (rotary), "
                    f"got {m.head_dim}")
        require(m.n_heads % m.n_kv_heads == 0, "model.n_kv_heads",
                f"must divide model.n_heads={m.n_heads}, got {m.n_kv_heads}")
        require(seq_len <= m.max_seq_len, "data.seq_len",
                f"{seq_len} exceeds model.max_seq_len={m.max_seq_len}")

    def build_on_meta(self, m: ModelConfig) -> nn.Module:
        from trainer.models.llama import build_llama

        return build_llama(llama_args(m), device="meta")

    def attention_modules(self, model: nn.Module) -> list[nn.Module]:
        from trainer.models.llama import Attention

        return [module for module in model.modules() if isinstance(module, Attention)]

    tileable = True

    def check_sequence(self, m: ModelConfig, degree: int) -> None:
        """The degree divides the attention heads; KV heads it does not divide are repeated
        (sharding/degrees.py's kv_repeats)."""
        from sharding.degrees import kv_repeats

        try:
            kv_repeats(m.n_heads, m.n_kv_heads, degree)
        except ValueError as exc:
            raise ConfigError("sharding.sequence", f"{exc} (model.n_heads={m.n_heads}, "
                              f"model.n_kv_heads={m.n_kv_heads})") from None

    def check_sequence_parallel(self, m: ModelConfig, degree: int = 1) -> None:
        """Every built-in Llama attends through its `attend` hook: nothing more to refuse."""
        self.check_sequence(m, degree)

    def mlp_of(self, block: nn.Module) -> nn.Module:
        return block.feed_forward

    def tile_block(self, block: nn.Module, tiles: int) -> bool:
        """Both token-wise halves: attention_norm with wq/wk/wv, and ffn_norm with the MLP
        (trainer/models/llama.py's Block.tile)."""
        block.tile(tiles)
        return True

    def tile_head(self, model: nn.Module, tiles: int) -> None:
        """The final norm, tiled before the head (plain or chunked, all rows or gathered)."""
        model.tile_head(tiles)

    def check_context(self, m: ModelConfig, context: int, compiled: bool = False) -> None:
        """The ring serves every built-in Llama's attention (any heads: it carries the KV heads
        unrepeated), but has no attention dropout, which model.dropout also drives."""
        require(m.dropout == 0, "model.dropout", f"ring attention (sharding.context={context}) "
                f"has no attention dropout, and the built-in Llama's model.dropout drives it: "
                f"set model.dropout=0 (now {m.dropout})")

    def sequence_parallel(self, model: nn.Module, group: Optional[ProcessGroup],
                          context_group: Optional[ProcessGroup] = None) -> int:
        """Run `model` sequence-parallel over `group` (N ranks sharing each sample): every
        block's attention is wrapped in Ulysses' all-to-all (sharding/sequence.py) and the
        model remembers the group. From then on, rank r of the group calls the model as before
        (`model(tokens, positions=..., targets=..., chunk_tokens=...)`) with its contiguous
        slice r of each row, of width T/N: tokens, targets and, for packed rows, the slice of
        the packed positions (the model gathers the whole sequence's positions for the document
        mask). The result is that slice of the whole-sequence forward: logits [B, T/N, vocab],
        or the chunked head's loss summed over the slice's targets; the caller divides by the
        global supervised count and sums gradients over the group (FSDP's reduce does when the
        group is inside its mesh). Exact except attention dropout, which draws other masks (see
        trainer/models/sequence_parallel.py). With `context_group` (a ring of M places,
        sharding.context) each place holds a balanced pair of the 2M chunks of each row, its
        Ulysses group splitting that pair (sharding/ring.py's sample_slice), and the ring
        attends across places. Returns the attention modules wrapped."""
        from sharding.sequence import GroupExchange

        wrapped = 0
        # The ring first: Ulysses' wrap goes around it (its all-to-all gathers the ring
        # place's tokens for the ring, which attends over the ring's M places).
        if context_group is not None:
            wrapped = self.wrap_ring(model, context_group)
            model.context_group = context_group
        if group is not None:
            wrapped = self.wrap_ulysses(model, GroupExchange(group))
            model.sequence_group = group
        return wrapped

    def flops_per_token(self, m: ModelConfig, model: nn.Module, tokens_per_sample: int) -> float:
        from trainer.models.llama import flops_per_token

        return flops_per_token(llama_args(m), tokens_per_sample)


    # Export (`python -m trainer.export`): transformers' names of the block's parameters, and
    # which of them hold rotary pairs in their rows.
    hf_architecture = "LlamaForCausalLM"
    hf_layer_names = {"attention_norm.weight": "input_layernorm.weight",
                      "attention.wq.weight": "self_attn.q_proj.weight",
                      "attention.wk.weight": "self_attn.k_proj.weight",
                      "attention.wv.weight": "self_attn.v_proj.weight",
                      "attention.wo.weight": "self_attn.o_proj.weight",
                      "ffn_norm.weight": "post_attention_layernorm.weight",
                      "feed_forward.w1.weight": "mlp.gate_proj.weight",
                      "feed_forward.w3.weight": "mlp.up_proj.weight",
                      "feed_forward.w2.weight": "mlp.down_proj.weight"}
    rotary_rows = ("attention.wq.weight", "attention.wk.weight")

    def hf_config(self, model: Mapping) -> dict:
        """config.json in transformers' schema for the checkpoint's model section."""
        m = {**vars(ModelConfig()), **model}
        theta = float(m["rope_theta"])
        return {"architectures": [self.hf_architecture],
                "model_type": self.hf_architecture.removesuffix("ForCausalLM").lower(),
                "vocab_size": m["vocab_size"], "hidden_size": m["dim"],
                "intermediate_size": m["ffn_hidden"], "num_hidden_layers": m["n_layers"],
                "num_attention_heads": m["n_heads"], "num_key_value_heads": m["n_kv_heads"],
                "head_dim": m["head_dim"] or m["dim"] // m["n_heads"],
                "max_position_embeddings": m["max_seq_len"], "rms_norm_eps": m["norm_eps"],
                "rope_theta": theta, "rope_parameters": {"rope_type": "default",
                                                         "rope_theta": theta},
                "tie_word_embeddings": bool(m["tie_embeddings"]), "hidden_act": "silu",
                "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
                "dtype": "float32"}

    def export(self, tensors: Mapping[str, torch.Tensor], model: Mapping, out: str, step: int,
               checkpoint: str) -> str:
        """A folder `from_pretrained` loads: config.json in transformers' schema (with where it
        came from under "blocktrain") and model.safetensors under transformers' names. Our
        rotary turns interleaved feature pairs (2i, 2i+1) of a head, transformers' turns
        (i, i + head_dim/2): the rows of wq and wk (and Qwen3's head norms) are reordered to
        match, which leaves every attention score as it was."""
        from safetensors.torch import save_file

        config = self.hf_config(model)
        state = {}
        for name, tensor in tensors.items():
            if name == "output.weight" and config["tie_word_embeddings"]:
                continue  # the embedding is the head: transformers ties it on load
            state[self._hf_name(name)] = _halves(tensor, config["head_dim"]) if any(
                name.endswith("." + rows) for rows in self.rotary_rows) else tensor
        os.makedirs(out, exist_ok=True)
        save_file({k: v.contiguous() for k, v in state.items()},
                  os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
        config["blocktrain"] = {"model": dict(model), "step": step,
                                "checkpoint": os.path.abspath(checkpoint)}
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(config, f, indent=1, sort_keys=True)
        return out

    def adapter_tensor(self, name: str, tensor: torch.Tensor,
                       model: Mapping) -> tuple[str, torch.Tensor]:
        """Under transformers' name of the layer; lora_B's output rows of wq and wk reordered
        as `export` reorders those weights' rows (lora_A's input columns need nothing)."""
        layer, _, part = name.rpartition(".lora_")
        hf_layer = self._hf_name(layer + ".weight").removesuffix(".weight")
        if part.startswith("B") and any((layer + ".weight").endswith("." + rows)
                                        for rows in self.rotary_rows):
            tensor = _halves(tensor, self.hf_config(model)["head_dim"])
        return f"{hf_layer}.lora_{part}", tensor

    def _hf_name(self, name: str) -> str:
        top = {"tok_embeddings.weight": "model.embed_tokens.weight",
               "norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
        if name in top:
            return top[name]
        _, layer, rest = name.split(".", 2)  # layers.<i>.<parameter>
        return f"model.layers.{layer}.{self.hf_layer_names[rest]}"


def _halves(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows [heads * head_dim, ...] from interleaved rotary pairs to split halves, per head."""
    return rows.unflatten(0, (-1, head_dim // 2, 2)).transpose(1, 2).reshape(rows.shape)


FAMILY = Llama()
