"""What the GPU probes of the backward share (benchmarks/probes/probe_hopper_bwd.py, probe_hopper_bwd256.py, probe_hopper_dq.py,
probe_onepass128.py): a check row judged by the flash-attn 2x rule, with any failure recorded instead of raised, and a
provider's backward timed over rounds at one extended-sweep point."""
import contextlib
import traceback

from benchmarks import bench
from fa_lib.testing import assert_flash_rule, reference_forward_backward


def judge(row, out, q, k, v, do, causal, digits=None):
    """Judge `out` (o, lse, dq, dk, dv, as `fa_lib.testing.forward_backward` returns them) by the flash-attn 2x rule
    against the float64 reference, with the reference in the inputs' dtype as the baseline; on a pass record ok and
    each output's error ratio in `row` (rounded to `digits` if given), else raise the rule's AssertionError."""
    gold = reference_forward_backward(q, k, v, do, causal=causal, upcast=True)
    base = reference_forward_backward(q, k, v, do, causal=causal, upcast=False)
    rep = assert_flash_rule(out, gold, base)
    row.update(ok=True, ratios={n: r[2] if digits is None else round(r[2], digits) for n, r in rep.items()})


@contextlib.contextmanager
def recorded(row):
    """Inside this block a failed rule (AssertionError) or a compile or launch failure is recorded in `row`
    (ok=False and the error) and the probe goes on to its next case."""
    try:
        yield
    except AssertionError as e:
        row.update(ok=False, error=str(e)[:400])
    except Exception:
        row.update(ok=False, error=traceback.format_exc()[-1500:])


def best_backward(row, name, provider, p, rounds, warmup=10, rep=50):
    """Time `provider` (as `bench.ext_bench_one` names it) `rounds` times at point `p` and keep the round with the
    least backward time in row["bwd_ms"][name] (and its forward in row["fwd_ms"][name] where the row has
    "fwd_ms"); an error ends the rounds and goes to row["errors"][name]."""
    best = None
    for _ in range(rounds):
        r = bench.ext_bench_one(provider, p, warmup=warmup, rep=rep)
        if r.get("error"):
            row.setdefault("errors", {})[name] = r["error"]
            break
        best = r if best is None or r["bwd_ms"] < best["bwd_ms"] else best
    if best is not None:
        row["bwd_ms"][name] = best["bwd_ms"]
        if "fwd_ms" in row:
            row["fwd_ms"][name] = best["fwd_ms"]
