"""Sequence packing for the update step: the real tokens of several rows of a PaddedBatch
(trainer/batch.py) laid end to end in one row, no padding, with position ids that restart at
each sequence and the boundaries (cu_seqlens) that trainer/packed_attention.py keeps
attention inside of."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from rollstream.trainer.batch import PaddedBatch


@dataclass
class PackedMicroBatch:
    """Sequences concatenated into one row of N tokens; every tensor is [N] unless noted.

    position_ids restart at 0 with each sequence; cu_seqlens ([S + 1], int32) are the
    sequences' cumulative lengths, max_length the longest. response_mask and
    behaviour_logprobs are aligned per token as in PaddedBatch; advantages are per token
    (each sequence's advantage repeated over its tokens). The first token of every sequence
    has response_mask 0 (nothing before it predicts it), so no trained token is ever
    predicted across a sequence boundary.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    response_mask: torch.Tensor
    behaviour_logprobs: torch.Tensor
    advantages: torch.Tensor
    max_length: int

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_sequences(self) -> int:
        return int(self.cu_seqlens.shape[0]) - 1

    @property
    def num_response_tokens(self) -> int:
        return int(self.response_mask.sum().item())

    def to(self, device: torch.device | str) -> PackedMicroBatch:
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, value in moved.items():
            if isinstance(value, torch.Tensor):
                moved[name] = value.to(device, non_blocking=True)
        return PackedMicroBatch(**moved)


def pack_rows(batch: PaddedBatch, rows: list[int]) -> PackedMicroBatch:
    """The given rows of `batch`, their real tokens (attention_mask 1) packed end to end."""
    if not rows:
        raise ValueError("pack_rows needs at least one row")
    lengths = batch.attention_mask[rows].sum(dim=1).tolist()
    if min(lengths) <= 0:
        raise ValueError("a row of the batch has no tokens; build_batch never makes one, was the batch edited?")
    picked: dict[str, list[torch.Tensor]] = {name: [] for name in ("input_ids", "response_mask", "behaviour_logprobs")}
    positions: list[torch.Tensor] = []
    advantages: list[torch.Tensor] = []
    for row, length in zip(rows, lengths):
        for name, parts in picked.items():
            parts.append(getattr(batch, name)[row, :length])
        positions.append(torch.arange(length, dtype=torch.long))
        advantages.append(batch.advantages[row].expand(length))
    cu_seqlens = torch.zeros(len(rows) + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int32), dim=0)
    response_mask = torch.cat(picked["response_mask"])
    # position 0 of each sequence has no prediction; build_batch already masks it, a
    # hand-built batch might not, and here a mistake would train across two sequences
    response_mask[cu_seqlens[:-1].long()] = 0.0
    return PackedMicroBatch(
        input_ids=torch.cat(picked["input_ids"]),
        position_ids=torch.cat(positions),
        cu_seqlens=cu_seqlens,
        response_mask=response_mask,
        behaviour_logprobs=torch.cat(picked["behaviour_logprobs"]) * response_mask,
        advantages=torch.cat(advantages).to(torch.float32),
        max_length=int(max(lengths)),
    )


def micro_batch_rows(
    batch: PaddedBatch, micro_batch_size: int, micro_batch_tokens: int | None = None
) -> list[list[int]]:
    """Rows of `batch` grouped into micro-batches, in order: at most `micro_batch_size`
    sequences each and, when `micro_batch_tokens` is given, at most that many tokens (a single
    longer sequence is a micro-batch of its own; sequences are never split)."""
    if micro_batch_size <= 0:
        raise ValueError(f"micro_batch_size must be positive, got {micro_batch_size}")
    if micro_batch_tokens is not None and micro_batch_tokens <= 0:
        raise ValueError(f"micro_batch_tokens must be positive, got {micro_batch_tokens}")
    lengths = batch.attention_mask.sum(dim=1).tolist()
    groups: list[list[int]] = []
    current: list[int] = []
    tokens = 0
    for row, length in enumerate(lengths):
        full = len(current) >= micro_batch_size
        over = micro_batch_tokens is not None and current and tokens + length > micro_batch_tokens
        if full or over:
            groups.append(current)
            current, tokens = [], 0
        current.append(row)
        tokens += length
    if current:
        groups.append(current)
    return groups


def pack_micro_batches(
    batch: PaddedBatch, micro_batch_size: int, micro_batch_tokens: int | None = None
) -> list[PackedMicroBatch]:
    """The whole batch as packed micro-batches (micro_batch_rows, then pack_rows)."""
    return [pack_rows(batch, rows) for rows in micro_batch_rows(batch, micro_batch_size, micro_batch_tokens)]
