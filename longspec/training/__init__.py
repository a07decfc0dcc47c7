"""Training the LongSpec draft (DESIGN.md 2.2): data from text / JSONL / source trees, anchor-offset
position indices, noisy (lagged) cross-attention, CE or distillation loss, a resumable trainer
that runs in one process or data parallel under ``torchrun``."""
from .data import (DataConfig, Document, PackedData, build_data, frequent_tokens, iter_documents, load_tokenizer,
                   split_documents)
from .loss import DraftLoss, LossSums, TargetOutputs, head_loss_sums, loss_sums, target_forward
from .positions import SINKS, anchor_offset_positions, offset_range, positions_from_offsets, sample_lag, sample_offsets
from .run import TrainResult, train
from .trainer import TrainConfig, Trainer, lr_at, sample_chunks

__all__ = ["DataConfig", "Document", "PackedData", "build_data", "frequent_tokens", "iter_documents", "load_tokenizer",
           "split_documents", "DraftLoss", "LossSums", "TargetOutputs", "head_loss_sums", "loss_sums", "target_forward",
           "SINKS",
           "anchor_offset_positions", "offset_range", "positions_from_offsets", "sample_lag", "sample_offsets",
           "TrainConfig", "Trainer", "TrainResult", "lr_at", "sample_chunks", "train"]
