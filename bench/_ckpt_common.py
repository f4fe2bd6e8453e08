"""Shared bits of the checkpoint benchmark: the model sizes it runs."""

from __future__ import annotations

from keel.workload.model import SIZES, GPTConfig

# The example GPT's sizes plus "bench": ~5.3M parameters, so that the model + AdamW state is ~64 MB (a
# few tens of MB: big enough that copying it shows, small enough for a step of ~0.25 s on one CPU thread).
BENCH_SIZES: dict[str, GPTConfig] = {
    **SIZES,
    "bench": GPTConfig(vocab_size=4096, seq_len=128, d_model=256, n_layers=4, n_heads=4),
}


def config_of(size: str) -> GPTConfig:
    try:
        return BENCH_SIZES[size]
    except KeyError:
        raise SystemExit(f"unknown --size {size!r}; one of {', '.join(BENCH_SIZES)}") from None
