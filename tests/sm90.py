"""Compiling kernels ahead of time for sm_90 (the H200's Hopper) on a machine without a GPU: Triton's own ptxas
needs only a target, which a stand-in for its CUDA driver names."""
import contextlib

import torch


class SM90Target:
    """A stand-in for Triton's CUDA driver that only names the target: enough to compile, not to launch."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


@contextlib.contextmanager
def compiling_for_sm90():
    """Inside this block `kernel.warmup(..., grid=...)` compiles for sm_90; the driver in use before is put back."""
    from triton.runtime import driver

    before = driver._active
    driver.set_active(SM90Target())
    try:
        yield
    finally:
        driver._active = before
