"""One training batch: dense features, jagged categorical features, labels."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from towerrec.sparse import KeyedJaggedTensor, can_pin_memory

__all__ = ["Batch", "DataSchema", "SparseFeature"]


@dataclass(frozen=True)
class SparseFeature:
    """A categorical feature as a data source declares it.

    ``num_embeddings`` is the id space (ids lie in ``[0, num_embeddings)``);
    ``pooling_factor`` the mean number of ids per sample (1 for single-hot).
    """

    name: str
    num_embeddings: int
    pooling_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.num_embeddings < 1:
            raise ValueError(f"feature {self.name!r}: num_embeddings must be >= 1")


@dataclass(frozen=True)
class DataSchema:
    """What a data source produces: dense width and the categorical features."""

    num_dense: int
    sparse: tuple[SparseFeature, ...]

    @property
    def sparse_names(self) -> list[str]:
        return [f.name for f in self.sparse]


@dataclass
class Batch:
    """``dense[B, F]`` float32, ``sparse`` with B samples per key, ``labels[B]`` float32.

    ``teacher_logits[B]`` float32, where present, is an external teacher's logit for each
    sample (distillation data); None for plain data.

    ``validate=True`` (the default) checks shapes, dtypes and that the dense
    features are finite, naming the first bad sample; loaders that produced the
    tensors themselves may skip it.
    """

    dense: torch.Tensor
    sparse: KeyedJaggedTensor
    labels: torch.Tensor
    teacher_logits: torch.Tensor | None = None
    validate: bool = field(default=True, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.validate:
            self.check()

    @property
    def size(self) -> int:
        return self.labels.shape[0]

    def check(self) -> None:
        dense, labels = self.dense, self.labels
        if dense.dim() != 2 or not dense.is_floating_point():
            raise ValueError(
                f"dense features must be a float tensor [B, F], got {dense.dtype} "
                f"{tuple(dense.shape)}"
            )
        if labels.dim() != 1:
            raise ValueError(f"labels must be [B], got shape {tuple(labels.shape)}")
        batch = labels.shape[0]
        if dense.shape[0] != batch:
            raise ValueError(f"dense has {dense.shape[0]} rows but there are {batch} labels")
        if self.sparse.keys() and self.sparse.stride() != batch:
            raise ValueError(
                f"sparse features have batch size {self.sparse.stride()} but there are "
                f"{batch} labels"
            )
        finite = torch.isfinite(dense)
        if not bool(finite.all()):
            sample, column = (~finite).nonzero()[0].tolist()
            raise ValueError(
                f"dense feature {column} of sample {sample} is {dense[sample, column].item()}; "
                "dense features must be finite (impute or drop NaN/inf values before training)"
            )
        if not bool(torch.isfinite(labels).all()) or bool(((labels < 0) | (labels > 1)).any()):
            bad = int((~torch.isfinite(labels) | (labels < 0) | (labels > 1)).nonzero()[0])
            raise ValueError(
                f"label of sample {bad} is {labels[bad].item()}; labels must lie in [0, 1]"
            )
        teacher = self.teacher_logits
        if teacher is not None:
            if teacher.shape != labels.shape or not teacher.is_floating_point():
                raise ValueError(
                    f"teacher logits must be a float tensor [{batch}], got {teacher.dtype} "
                    f"{tuple(teacher.shape)}"
                )
            finite = torch.isfinite(teacher)
            if not bool(finite.all()):
                bad = int((~finite).nonzero()[0])
                raise ValueError(
                    f"teacher logit of sample {bad} is {teacher[bad].item()}; teacher logits "
                    "must be finite (re-run the augmentation for this data)"
                )

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        return Batch(
            self.dense.to(device, non_blocking=non_blocking),
            self.sparse.to(device, non_blocking=non_blocking),
            self.labels.to(device, non_blocking=non_blocking),
            None
            if self.teacher_logits is None
            else self.teacher_logits.to(device, non_blocking=non_blocking),
            validate=False,
        )

    def pin_memory(self) -> Batch:
        """Page-locked copy (unchanged where no accelerator is present)."""
        if not can_pin_memory():
            return self
        return Batch(
            self.dense.pin_memory(),
            self.sparse.pin_memory(),
            self.labels.pin_memory(),
            None if self.teacher_logits is None else self.teacher_logits.pin_memory(),
            validate=False,
        )
