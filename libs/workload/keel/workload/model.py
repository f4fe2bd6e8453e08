"""A small GPT-style decoder language model, and its split into pipeline stages.

The model is deliberately plain (token + position embeddings, pre-LN transformer blocks with causal
self-attention and an MLP, a final LayerNorm and an untied LM head) so that it behaves like the real
thing under data and pipeline parallelism while staying small enough for CPU tests.

Initialisation is a pure function of ``(config, seed)``: every rank of a job builds the same full model
from the same seed and keeps only its own stage, so data-parallel replicas start bitwise identical.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTConfig", "SIZES", "GPT", "Block", "PipelineStage", "build_model", "split_stages", "stage_layers"]


@dataclass(frozen=True)
class GPTConfig:
    """Model shape. ``d_model`` must be divisible by ``n_heads``; the MLP hidden size is ``4 * d_model``."""

    vocab_size: int
    seq_len: int
    d_model: int
    n_layers: int
    n_heads: int

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}")
        if min(self.vocab_size, self.seq_len, self.d_model, self.n_layers, self.n_heads) < 1:
            raise ValueError(f"every dimension must be positive: {self}")


SIZES: dict[str, GPTConfig] = {
    # ~0.06M parameters: a step is a few milliseconds; for unit tests and fault scenarios.
    "tiny": GPTConfig(vocab_size=64, seq_len=32, d_model=32, n_layers=2, n_heads=2),
    # ~0.9M parameters.
    "small": GPTConfig(vocab_size=512, seq_len=64, d_model=128, n_layers=4, n_heads=4),
    # ~33.6M parameters: checkpoint and transfer benchmarks.
    "medium": GPTConfig(vocab_size=8192, seq_len=128, d_model=512, n_layers=8, n_heads=8),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """Pre-LN transformer block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(), nn.Linear(4 * cfg.d_model, cfg.d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Embedding(nn.Module):
    """Token + learned position embeddings: ``[B, T]`` token ids to ``[B, T, d_model]``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.tok(idx) + self.pos(positions)


class Head(nn.Module):
    """Final LayerNorm and the LM head: ``[B, T, d_model]`` to logits ``[B, T, vocab]``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


class GPT(nn.Module):
    """The full model: token ids ``[B, T]`` (``T <= seq_len``) to logits ``[B, T, vocab_size]``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed = Embedding(cfg)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.head = Head(cfg)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _init_weights(model: GPT, generator: torch.Generator) -> None:
    cfg = model.config
    # GPT-2 style: N(0, 0.02), residual projections scaled down by depth, zero biases, unit LayerNorms.
    residual_std = 0.02 / math.sqrt(2 * cfg.n_layers)
    for name, param in model.named_parameters():
        with torch.no_grad():
            if name.endswith("bias"):
                param.zero_()
            elif ".ln" in name or name.startswith("head.ln_f"):
                param.fill_(1.0)
            else:
                std = residual_std if name.endswith(("attn.proj.weight", "mlp.2.weight")) else 0.02
                param.copy_(torch.randn(param.shape, generator=generator) * std)


def build_model(cfg: GPTConfig, seed: int) -> GPT:
    """Build the full model with weights that depend only on ``(cfg, seed)``; the global RNG is untouched."""
    with torch.random.fork_rng(devices=[]):  # nn.Module constructors draw default inits from the global RNG
        model = GPT(cfg)
    _init_weights(model, torch.Generator().manual_seed(seed))
    return model


def stage_layers(n_layers: int, pp: int) -> list[range]:
    """Which blocks each of ``pp`` stages holds: contiguous, earlier stages take the remainder.

    A stage may hold no block when ``pp > n_layers`` (it then only forwards activations, or holds
    the embeddings / head).
    """
    if pp < 1:
        raise ValueError(f"pp must be >= 1, got {pp}")
    base, extra = divmod(n_layers, pp)
    ranges, start = [], 0
    for stage in range(pp):
        count = base + (1 if stage < extra else 0)
        ranges.append(range(start, start + count))
        start += count
    return ranges


class PipelineStage(nn.Module):
    """One pipeline stage. Stage 0 takes token ids ``[B, T]``; any other stage takes activations
    ``[B, T, d_model]``. The last stage returns logits ``[B, T, vocab]``; any other returns activations.
    """

    def __init__(self, index: int, num_stages: int, embed: Embedding | None, blocks: Sequence[nn.Module],
                 head: Head | None) -> None:
        """``blocks``: the model's ``Block``s of this stage, in order (``GPT.blocks`` holds them as modules)."""
        super().__init__()
        self.index = index
        self.num_stages = num_stages
        self.embed = embed
        self.blocks = nn.ModuleList(blocks)
        self.head = head

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        if self.head is not None:
            x = self.head(x)
        return x


def split_stages(model: GPT, pp: int) -> list[PipelineStage]:
    """Split ``model`` into ``pp`` stages that share its parameters (no copies).

    Stage 0 holds the embeddings and the first blocks, the last stage the last blocks, the final
    LayerNorm and the LM head; composing the stages in order equals ``model.forward``.
    """
    ranges = stage_layers(model.config.n_layers, pp)
    return [
        PipelineStage(
            index=i,
            num_stages=pp,
            embed=model.embed if i == 0 else None,
            blocks=[model.blocks[j] for j in layers],
            head=model.head if i == pp - 1 else None,
        )
        for i, layers in enumerate(ranges)
    ]
