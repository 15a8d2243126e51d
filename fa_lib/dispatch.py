"""From a problem to what the kernels are told: the encodings every launcher shares.

The layer between the input checks (``fa_lib.checks``) and the launches (``fa_lib.launch``): pure functions of the
problem (shapes, dtypes, masks, options) that give the kernels' compile-time arguments (``_meta``), the mask band
(``_band``), the soft-cap mode (``_softcap_mode``) and integer helpers. ``fa_lib.ops`` and ``fa_lib.decode`` both
build their launches from these; neither imports the other for them.
"""
import torch

from . import kernels

# Above this cap the kernels use the accurate tanh near 0 (SOFTCAP = 2): the fast one adds ~1.2e-7 c to
# every capped score, 1.2e-5 at c = 100 (Gemma 2 caps at 50 and 30).
_FAST_TANH_MAX_CAP = 100.0


def _next_pow2(n):
    """The smallest power of two >= n (n >= 1). Plain Python: Triton's `next_power_of_2` and `cdiv` are
    constexpr functions whose calls cost microseconds of host time on every launch."""
    return 1 << (n - 1).bit_length()


def _cdiv(a, b):
    return -(-a // b)


def _one_tile(head_dim):
    """The tiled kernels' column tiles as one padded tile: the head dim rounded up to a power of two, at least the
    smallest GPU dot (HEAD_DIM2 = 0), and whether the tile runs past the head dim (MASK_D)."""
    tile = max(16, _next_pow2(head_dim))
    return dict(HEAD_DIM=tile, HEAD_DIM2=0, MASK_D=head_dim != tile)


def _meta(q, causal, addr="i64"):
    """Compile-time arguments shared by the tiled kernels; `addr`: see `_addr`. The column tiles are one
    padded tile here (HEAD_DIM2 = 0); the launchers that take two update them from `ops._tile_meta`."""
    return dict(
        **_one_tile(q.shape[3]),
        CAUSAL=causal,
        # bf16 tl.dot and bf16 rounding are broken under the interpreter (triton issue 11584);
        # emulate them there with float32 arithmetic (see fa_lib.kernels).
        EMULATE_BF16=kernels.INTERPRET and q.dtype == torch.bfloat16,
        # float32 inputs: exact float32 products ("ieee"), not TF32 -- correctness first; see
        # `flash_attention`'s docstring. 16-bit inputs ignore this setting.
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        ADDR=addr,
    )


def _softcap_mode(softcap):
    """The kernels' SOFTCAP: 0 (no cap), 1 (the fast tanh) or 2 (the accurate tanh, for large caps)."""
    return 0 if softcap == 0 else (1 if softcap <= _FAST_TANH_MAX_CAP else 2)


def _band(causal, window):
    """The kernels' view of the mask band: (CAUSAL, LOCAL, WIN_LEFT, WIN_RIGHT). Query i sees key j iff
    j <= i + N_K - N_Q + WIN_RIGHT (when CAUSAL: the band has a right edge; plain causal is WIN_RIGHT = 0)
    and j >= i + N_K - N_Q - WIN_LEFT (when LOCAL: a left edge)."""
    left, right = window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    return right >= 0, left >= 0, max(left, 0), max(right, 0)
