"""Parametrisation shared by the CPU (interpreter) and GPU kernel tests."""
import pytest
import torch

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


def case(batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, causal, dtype, layout="bhnd"):
    """One pytest case of flash_attention's shape space, with a readable id such as
    ``B2-H4x2-N17x33-D40-causal-float16-bhnd`` (layout "bnhd" means a view of (B, N, H, D) storage)."""
    name = (f"B{batch}-H{heads_q}x{heads_kv}-N{seqlen_q}x{seqlen_k}-D{head_dim}-"
            f"{'causal' if causal else 'full'}-{str(dtype)[6:]}-{layout}")
    return pytest.param(batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, causal, dtype, layout, id=name)
