"""Chapter 9: the key-block loop of a Triton forward kernel (launched under the interpreter)."""
import numpy as np

from .. import reference
from ._common import _fail


# ---------------------------------------------------------------------------------------------------
# Chapter 9: the key-block loop of a Triton forward kernel (launched under the interpreter).
# ---------------------------------------------------------------------------------------------------
FORWARD_LOOP_TOL = 2e-4  # float32 tiles, scores up to ~150: a few float32 ulps of the scores
_SENTINEL = 12345.0  # what O and LSE hold past row N_Q; a store without a mask overwrites it


def _forward_loop_cases():
    """(what, q, k, v, BLOCK_M, BLOCK_N): float32 NumPy arrays, one head, non-causal."""
    rng = np.random.default_rng(9)

    def qkv(nq, nk, d, scale=1.0):
        return tuple((rng.standard_normal(shape) * s).astype(np.float32)
                     for shape, s in (((nq, d), scale), ((nk, d), scale), ((nk, d), 1.0)))

    # scores that grow from key block to key block: keys drift towards the common query direction
    d, nk = 16, 48
    q_up = (rng.standard_normal((16, d)) * 0.3 + 1.0).astype(np.float32)
    ramp = np.repeat(np.arange(3.0), 16)[:, None]  # key block 0, 1, 2 -> 0, 1, 2
    k_up = (rng.standard_normal((nk, d)) * 0.3 + 0.5 * ramp).astype(np.float32)
    v_up = rng.standard_normal((nk, d)).astype(np.float32)
    return [
        ("N_Q = N_K = 32, d = 16, BLOCK_M = BLOCK_N = 16 (the blocks divide the lengths)",
         *qkv(32, 32, 16), 16, 16),
        ("the maximum grows in every key block (the old l_i and acc must be rescaled by alpha)",
         q_up, k_up, v_up, 16, 16),
        ("N_Q = 40, N_K = 40, BLOCK_M = 32, BLOCK_N = 16 (the last query block and the last "
         "key block are partial)", *qkv(40, 40, 16), 32, 16),
        ("N_K = 20 keys with BLOCK_N = 32 (a single, partial key block)", *qkv(24, 20, 32), 16, 32),
        ("scores up to about 150 (exp overflows in float32 without the running maximum)",
         *qkv(20, 36, 16, scale=7.0), 16, 16),
        ("a single query (N_Q = 1), N_K = 50, d = 32", *qkv(1, 50, 32), 16, 16),
    ]


def _kernel_kind(fn):
    """'interpreted', 'compiled', or None when fn is no @triton.jit kernel."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction
    except ImportError:  # pragma: no cover - triton is a dependency of fa_lib
        return None
    if isinstance(fn, InterpretedFunction):
        return "interpreted"
    if isinstance(fn, JITFunction):
        return "compiled"
    return None


def _launch_forward_loop(kernel, q, k, v, block_m, block_n, fill):
    """The chapter's launcher: one program per block of BLOCK_M query rows, on CPU tensors.

    Q, K and V sit at the start of contiguous buffers one block longer than needed, whose extra rows
    hold ``fill`` (NaN: a load that forgets its mask reads them); O and LSE in buffers that start as
    NaN (a row never written shows) and whose rows past N_Q hold a sentinel (an unmasked store
    overwrites it). Returns o (N_Q, d), lse (N_Q,) and whether the rows past N_Q stayed untouched.
    """
    import torch

    nq, nk, d = q.shape[0], k.shape[0], q.shape[1]

    def buffer(x, block):
        buf = torch.full((-(-x.shape[0] // block) * block + block, d), fill, dtype=torch.float32)
        buf[:x.shape[0]] = torch.from_numpy(x)
        return buf

    q_t, k_t, v_t = buffer(q, block_m), buffer(k, block_n), buffer(v, block_n)
    o_buf = torch.full((q_t.shape[0], d), float("nan"), dtype=torch.float32)
    lse_buf = torch.full((q_t.shape[0],), float("nan"), dtype=torch.float32)
    o_buf[nq:], lse_buf[nq:] = _SENTINEL, _SENTINEL
    from .._interpreter import language_restored

    with np.errstate(all="ignore"), language_restored():
        kernel[(-(-nq // block_m),)](q_t, k_t, v_t, o_buf, lse_buf, nq, nk, 1.0 / np.sqrt(d),
                                     HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n)
    untouched = bool(torch.all(o_buf[nq:] == _SENTINEL) and torch.all(lse_buf[nq:] == _SENTINEL))
    return o_buf[:nq].numpy(), lse_buf[:nq].numpy(), untouched


def check_triton_forward_loop(fn):
    """Chapter 9. ``fn`` is a ``@triton.jit`` kernel with the signature

        my_forward_kernel(Q, K, V, O, LSE, N_Q, N_K, sm_scale,
                          HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr)

    for one head, without a mask: ``Q`` (N_Q, HEAD_DIM), ``K`` and ``V`` (N_K, HEAD_DIM), ``O``
    (N_Q, HEAD_DIM) and ``LSE`` (N_Q,), all contiguous float32 (row stride HEAD_DIM). The checker
    launches it on the grid ``(cdiv(N_Q, BLOCK_M),)`` on CPU tensors, under Triton's interpreter (the
    kernel must be defined while ``TRITON_INTERPRET=1``, which ``import fa_lib`` sets on a machine
    without a GPU), and compares ``O`` and the natural-log ``LSE`` with ``fa_lib.naive_attention`` in
    float64. Rows past the ends of the tensors hold NaN (reading them unmasked shows) and a sentinel
    (writing them shows).
    """
    kind = _kernel_kind(fn)
    if kind is None:
        if callable(fn):
            raise TypeError(f"pass your function itself, decorated with @triton.jit: "
                            f"{getattr(fn, '__name__', 'it')} is a plain Python function, and the "
                            f"checker launches it as kernel[grid](...)")
        raise TypeError(f"pass your function itself, the @triton.jit kernel (e.g. "
                        f"check_triton_forward_loop(my_forward_kernel)), got {type(fn).__name__}")
    if kind == "compiled":
        raise TypeError("your kernel was defined for the Triton compiler, not the interpreter, and the "
                        "checker runs it on CPU tensors: set TRITON_INTERPRET=1 before `import triton` "
                        "(on a machine without a GPU, `import fa_lib` first does it), then run the cell "
                        "that defines the kernel again")
    cases = _forward_loop_cases()
    for case, q, k, v, block_m, block_n in cases:
        q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
        want = dict(zip(("o", "lse"), reference.naive_attention(q64, k64, v64)))
        try:
            got_o, got_lse, untouched = _launch_forward_loop(fn, q, k, v, block_m, block_n, np.nan)
        except Exception as e:  # a shape or type error inside the kernel
            last = str(e).strip().splitlines()[-1][:300] if str(e).strip() else ""
            _fail(case, f"launching your kernel raised {type(e).__name__}: {last} -- check the tile "
                        f"shapes: q and acc (BLOCK_M, HEAD_DIM), the key tile of q @ kT (HEAD_DIM, "
                        f"BLOCK_N), the value tile (BLOCK_N, HEAD_DIM), m_i and l_i (BLOCK_M,)")
        if not untouched:
            _fail(case, f"your kernel wrote past row N_Q = {q.shape[0]} of O or LSE: mask the stores "
                        f"with offs_m < N_Q")
        got = {"o": got_o, "lse": got_lse}
        # what a kernel gives that counts the zero-filled keys of the last block as keys of score 0
        n_pad = -(-k.shape[0] // block_n) * block_n - k.shape[0]
        zeros = np.zeros((n_pad, k.shape[1]))
        padded = dict(zip(("o", "lse"), reference.naive_attention(
            q64, np.concatenate([k64, zeros]), np.concatenate([v64, zeros]))))
        unscaled = dict(zip(("o", "lse"), reference.naive_attention(q64, k64, v64, softmax_scale=1.0)))
        # the final l_i, counted in units of each row's maximum: o * l_i is acc before the division
        l_final = np.exp(want["lse"] - (q64 @ k64.T / np.sqrt(q.shape[1])).max(axis=1))
        for name in ("lse", "o"):
            g, w = got[name], want[name]
            if np.isnan(g).any():
                where = list(int(i) for i in np.argwhere(np.isnan(g))[0])
                clean = _launch_forward_loop(fn, q, k, v, block_m, block_n, 0.0)[0 if name == "o" else 1]
                hint = ("a key past N_K was read without a mask, and the rows past the end hold NaN here: "
                        "load the partial last key block with mask=cols < N_K, other=0"
                        if not np.isnan(clean).any() else
                        "a row that was never written stays NaN; otherwise look for an exp that overflows "
                        "to inf (subtract the running maximum first), inf - inf or 0 / 0")
                _fail(case, f"{name}{where} is NaN ({hint})")
            close = np.isclose(g, w, rtol=FORWARD_LOOP_TOL, atol=FORWARD_LOOP_TOL)
            if close.all():
                continue
            where = tuple(int(i) for i in np.argwhere(~close)[0])

            def like(x):
                return np.allclose(g, x, rtol=1e-3, atol=1e-3)

            if n_pad and like(padded[name]):
                hint = (f"the {n_pad} zero-filled keys past N_K in the last block counted as keys with "
                        f"score 0: set the scores of the columns past N_K to -inf before the maximum")
            elif like(unscaled[name]):
                hint = "the scores miss the softmax scale: s = tl.dot(q, kT) * sm_scale"
            elif name == "lse" and like(w / np.log(2)):
                hint = "this is log2: the LSE is in natural log, m_i + log(l_i)"
            elif name == "lse":
                hint = "lse = m_i + log(l_i), with l_i rescaled by alpha = exp(m_old - m_new) each step"
            elif like(w * l_final[:, None]):
                hint = "o is acc before the division: divide acc by l_i once, after the loop"
            else:
                hint = ("lse is right, so l_i is; multiply acc by alpha = exp(m_old - m_new) too, "
                        "before adding p @ v")
            _fail(case, f"{name}{list(where)} = {g[where]:.4g}, expected {w[where]:.4g} ({hint})")
    return f"all {len(cases)} hidden cases pass"
