"""Which fp8 conversion a decode launch runs, and the clear error for a conversion that cannot apply (CPU)."""

from __future__ import annotations

import pytest
import torch

from sglx.attention.kernels.decode_attention import FP8_CONVERTS, DecodeConfig, _fp8_convert_code

CPU = torch.device("cpu")


def test_native_kv_never_converts():
    assert _fp8_convert_code(DecodeConfig(fp8_convert="bits_k"), 0, torch.float16, CPU, False) == 0


def test_explicit_choice_is_kept():
    for name, code in FP8_CONVERTS.items():
        assert _fp8_convert_code(DecodeConfig(fp8_convert=name), 1, torch.bfloat16, CPU, False) == code


def test_cpu_default_is_the_cast():
    assert _fp8_convert_code(DecodeConfig(), 1, torch.bfloat16, CPU, False) == FP8_CONVERTS["cast"]


@pytest.mark.parametrize("fmt,dtype", [(2, torch.bfloat16), (1, torch.float16), (2, torch.float16)])
def test_bits_k_outside_e4m3_and_bfloat16_says_what_to_use(fmt, dtype):
    with pytest.raises(ValueError, match="bits_k.*e4m3.*bfloat16.*ptx_kv"):
        _fp8_convert_code(DecodeConfig(fp8_convert="bits_k"), fmt, dtype, CPU, False)
