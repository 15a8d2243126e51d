"""Checkers for the book's implement-it-yourself exercises.

Each checker runs a function you wrote on hidden cases (awkward sizes, causal masks, rows that see no
key, scores large enough to overflow ``exp``), compares it with ``fa_lib.reference``, and either
returns a one-line summary or raises :class:`ExerciseFailure` with a message that says which case
failed and how: the shape, the first wrong value, a NaN, or, where the wrong answer equals a common
mistake's (computed on the case), that mistake by name: a forgotten rescale, a top-left causal mask, a
missing -inf guard, a transposed factor, a local D.

    from fa_lib import exercises
    exercises.check_online_update(my_update)          # chapter 2
    exercises.check_tiled_forward(my_forward)         # chapter 3
    exercises.check_matmul_backward(my_matmul_grads)  # chapter 4
    exercises.check_softmax_backward(my_softmax_bwd)  # chapter 5
    exercises.check_softmax_jacobian(my_jacobian)     # chapter 5
    exercises.check_attention_backward(my_attn_bwd)   # chapter 6 (the N x N matrices)
    exercises.check_backward_tile(my_tile_backward)   # chapter 6
    exercises.check_blockwise_backward(my_backward)   # chapter 7
    exercises.check_memory_traffic(my_traffic)        # chapter 7 (HBM elements, per head)
    exercises.check_tile_classes(my_classes)          # chapter 8 (NumPy alone)
    exercises.check_triton_forward_loop(my_kernel)    # chapter 9 (a @triton.jit kernel)
    exercises.check_d_preprocess(my_preprocess)       # chapter 10
    exercises.check_attention_flops(my_flops)         # chapter 11 (plain Python)
    exercises.check_split_merge(my_merge)             # chapter 12
    exercises.check_ring_lse(my_ring_lse)             # chapter 13
    exercises.check_ring_step(my_step)                # chapter 13

All arrays are NumPy float64 unless a checker says otherwise, so that a wrong formula cannot hide
behind rounding. The checkers of chapters 9 and 10 launch Triton kernels on CPU torch tensors, under
Triton's interpreter, and allow for float32 rounding; the NumPy checkers need NumPy alone.

Each topic's checkers live in a module of this package (``_common`` holds what they share) and are
re-exported here.
"""
from ._common import ExerciseFailure
from .attention_backward import check_attention_backward
from .backward import check_blockwise_backward, check_d_preprocess
from .backward_tile import check_backward_tile
from .decoding import check_split_merge
from .jacobian import check_softmax_jacobian
from .masks import check_tile_classes
from .matmul import check_matmul_backward
from .online import check_online_update, check_tiled_forward
from .performance import check_attention_flops
from .ring import check_ring_lse, check_ring_step
from .softmax import check_softmax_backward
from .traffic import check_memory_traffic
from .triton_forward import check_triton_forward_loop

__all__ = ["ExerciseFailure"] + sorted(name for name in dir() if name.startswith("check_"))
