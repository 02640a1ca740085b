"""The shared Llama building blocks (``moa_serve.model.layers``) under the memory layouts a GPU gives them."""

import pytest
import torch
import torch.nn.functional as F

from moa_serve.model.layers import attend


def _strided_sdpa(real):
    """``scaled_dot_product_attention`` whose output has the values of ``real`` but is not
    contiguous, as CUDA's kernels return it on the grouped-query path."""

    def sdpa(*args, **kwargs):
        out = real(*args, **kwargs)  # [B, H, T, hd]
        strided = out.transpose(1, 2).contiguous().transpose(1, 2)  # same values, heads innermost but one
        assert not strided.is_contiguous()
        return strided

    return sdpa


@pytest.mark.parametrize("masked", [False, True])
def test_grouped_query_attend_takes_a_non_contiguous_attention_output(monkeypatch, masked):
    gen = torch.Generator().manual_seed(0)
    b, heads, kv_heads, t, length, hd = 2, 6, 2, 3, 7, 8
    q = torch.randn(b, heads, t, hd, generator=gen)
    k = torch.randn(b, kv_heads, length, hd, generator=gen)
    v = torch.randn(b, kv_heads, length, hd, generator=gen)
    mask = torch.ones(b, 1, t, length, dtype=torch.bool).tril(diagonal=length - t) if masked else None
    want = F.scaled_dot_product_attention(
        q, k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1), attn_mask=mask
    )
    monkeypatch.setattr(F, "scaled_dot_product_attention", _strided_sdpa(F.scaled_dot_product_attention))
    got = attend(q, k, v, mask)
    torch.testing.assert_close(got, want)
