"""`offsets_fit_int32` decides whether a kernel may compute pool offsets in 32 bits: it must say no as soon as one
element's offset reaches 2**31, from the shape and strides (meta tensors: nothing is allocated)."""

from __future__ import annotations

import torch

from sglx.attention.kernels.common import offsets_fit_int32


def test_the_last_element_decides() -> None:
    rows = 2**31 // 256  # [rows, 2, 128]: the last element's offset is 2**31 - 1
    assert offsets_fit_int32(torch.empty(rows, 2, 128, device="meta"))
    assert not offsets_fit_int32(torch.empty(rows + 1, 2, 128, device="meta"))
    assert not offsets_fit_int32(torch.empty(8, 2, 128, device="meta"), torch.empty(rows + 1, 2, 128, device="meta"))


def test_strides_not_sizes_decide() -> None:
    rows = 2**31 // 256 + 1
    one_head = torch.empty(rows, 2, 128, device="meta")[:, :1]  # half the elements, the parent's row stride
    assert one_head.numel() < 2**31 and not offsets_fit_int32(one_head)
    assert offsets_fit_int32(torch.zeros(1).expand(2**40))  # stride 0: every element at offset 0
    assert offsets_fit_int32(torch.empty(0, 2, 128, device="meta"))
