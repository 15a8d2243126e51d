"""Checkers for the book's implement-it-yourself exercises.

Each checker runs a function you wrote on hidden cases (awkward sizes, causal masks, rows that see no
key, scores large enough to overflow ``exp``), compares it with ``fa_lib.reference``, and either
returns a one-line summary or raises :class:`ExerciseFailure` with a message that says which case
failed and how: the shape, the first wrong value, a NaN, a forgotten rescale.

    from fa_lib import exercises
    exercises.check_online_update(my_update)          # chapter 2
    exercises.check_tiled_forward(my_forward)         # chapter 3
    exercises.check_blockwise_backward(my_backward)   # chapter 7
    exercises.check_triton_forward_loop(my_kernel)    # chapter 9 (a @triton.jit kernel)
    exercises.check_d_preprocess(my_preprocess)       # chapter 10
    exercises.check_ring_step(my_step)                # chapter 14

All arrays are NumPy float64 unless a checker says otherwise, so that a wrong formula cannot hide
behind rounding. The checkers of chapters 9 and 10 launch Triton kernels on CPU torch tensors, under
Triton's interpreter, and allow for float32 rounding; the NumPy checkers need NumPy alone.

Each topic's checkers live in a module of this package (``_common`` holds what they share) and are
re-exported here.
"""
from ._common import ExerciseFailure
from .backward import check_blockwise_backward, check_d_preprocess
from .online import check_online_update, check_tiled_forward
from .ring import check_ring_step
from .triton_forward import check_triton_forward_loop

__all__ = ["ExerciseFailure", "check_blockwise_backward", "check_d_preprocess", "check_online_update",
           "check_ring_step", "check_tiled_forward", "check_triton_forward_loop"]
