"""Launch plans: the launches of one dense forward or backward, recorded the first time a problem is seen
and replayed on every later call with the same problem.

Between its input checks and its kernels, a call of `fa_lib.flash_attention` decides: which kernel (the
sm_90 Gluon kernel or the portable one), its blocks (the table, the small-grid rows), its column tiles,
its addressing, its grid, and the dozens of integer arguments of the launch. Each decision is a function
of the problem alone: the shapes, strides and dtype of the tensors, whether their data pointers are
16-byte aligned, the device and the scalar options, and the kernel options in force (`fa_lib.kernel_options`,
part of every plan's key). On the H200 machine that Python took longer than the kernels on the
small batches of the extended sweep (`benchmarks/data/probe-host-fwd-nvidia-h200.json`), so a small training step waited for it.

A plan keeps what the slow path launched for one problem: each launch's kernel, grid and arguments, with
every tensor argument replaced by its place among the call's tensors (q, k, v, o, lse, ...; a Gluon TMA
descriptor by the tensor it describes and its block), and the scratch buffers, the stream waits and the
stream of each launch in order. A later call with the same key fills the call's own tensors into those
places and launches the same compiled kernels directly. Nothing is recorded where the slow path does
work that is not a launch through `fa_lib.launch` (a key padding mask's bounds, the prefill route's
fill, the atomic dQ's zeroing, the autotuner): `taint` marks such a path, and it keeps running the slow
way.

A call under other kernel options never replays a plan recorded under different ones: the options are part of
the key. A block table changed in place (``BWD_STAGES[128] = 3``) is not seen: call `clear()` after such a
change, or run under ``fa_lib.kernel_options(plans=False)``.
"""
import torch

from . import kernels, launch
from .options import current

__all__ = ["clear", "info", "get", "start", "finish", "abort", "taint", "scratch", "contiguous", "wait_stream"]

MAX_PLANS = 4096  # problems kept; past this, new problems run the slow way (a loop over ever-new shapes)
_PLANS = {}
_STATS = {"recorded": 0, "replayed": 0, "declined": 0}
_REC = None  # the recording in progress, or None

_Tensor = torch.Tensor


def clear():
    """Drop every plan (after changing one of fa_lib's settings in place) and zero the counts."""
    _PLANS.clear()
    for k in _STATS:
        _STATS[k] = 0


def info():
    """{"plans": kept, "recorded", "replayed", "declined"}: this process's counts since the last `clear()`."""
    return dict(_STATS, plans=len(_PLANS))


def get(key):
    """The plan of problem `key`, or None."""
    return _PLANS.get(key)


class _Recording:
    __slots__ = ("slots", "steps", "tainted", "device", "main")

    def __init__(self, slots, device):
        self.slots = list(slots)
        # ("launch", kernel, grid, args, kwargs, stream) | ("alloc", shape, dtype) | ("contig", slot) | ("wait", a, b)
        self.steps = []
        self.tainted = False
        self.device = device
        self.main = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None


def start(slots, device):
    """Begin recording the launches of a call whose tensors are `slots` (a tuple, in the plan's order)."""
    global _REC
    _REC = _Recording(slots, device)
    launch.set_recorder(record_launch)
    tensors = [id(t) for t in slots if t is not None]
    if len(set(tensors)) != len(tensors):  # one tensor in two places (q is k): a replay could not tell them apart
        _REC.tainted = True


def abort():
    """Stop recording without keeping a plan (the slow path raised)."""
    global _REC
    _REC = None
    launch.set_recorder(None)


def taint():
    """The path being recorded does work that is not a launch: keep no plan of it."""
    if _REC is not None:
        _REC.tainted = True


def scratch(t):
    """`t` is a buffer the path just allocated with `ops._empty`: a replay allocates its own."""
    if _REC is not None:
        _REC.slots.append(t)
        _REC.steps.append(("alloc", tuple(t.shape), t.dtype))


def contiguous(t):
    """``t.contiguous()``, recorded: where that makes a copy, a replay makes the same copy of its own tensor."""
    c = t.contiguous()
    if _REC is not None and c is not t:
        i = next((i for i, s in enumerate(_REC.slots) if s is t), None)
        if i is None:
            _REC.tainted = True
        else:
            _REC.slots.append(c)
            _REC.steps.append(("contig", i))
    return c


def _stream_tag(rec, stream):
    return None if stream.cuda_stream == rec.main else stream


def wait_stream(waiter, waitee):
    """``waiter.wait_stream(waitee)``, recorded."""
    waiter.wait_stream(waitee)
    if _REC is not None:
        _REC.steps.append(("wait", _stream_tag(_REC, waiter), _stream_tag(_REC, waitee)))


def record_launch(kernel, grid, args, kwargs):
    """Called by `launch.launch` while recording (before it launches): `start` sets it as the recorder."""
    rec = _REC
    stream = None
    if rec.device.type == "cuda":
        stream = _stream_tag(rec, torch.cuda.current_stream(rec.device))
    rec.steps.append(("launch", kernel, tuple(grid), tuple(args), kwargs, stream))


def _template(args, slots):
    """(constants, [(position, slot)], [(position, slot, builder, block, layout)]) for `args`, or None where an argument
    is a tensor that is not one of `slots` (made inside the path: not replayable) or of an unknown kind."""
    ids = {id(t): i for i, t in enumerate(slots)}
    const, subs, descs = [], [], []
    for pos, a in enumerate(args):
        if isinstance(a, _Tensor):
            i = ids.get(id(a))
            if i is None:
                return None
            subs.append((pos, i))
            const.append(None)
        elif type(a).__name__ == "TensorDescriptor" and isinstance(getattr(a, "base", None), _Tensor):
            i = ids.get(id(a.base))
            if i is None:
                return None
            from .kernels_hopper import _desc  # (a Gluon descriptor: this Triton has Gluon)

            descs.append((pos, i, _desc, a.block_shape, a.layout))
            const.append(None)
        elif a is None or type(a) in (int, float, bool, str):
            const.append(a)
        else:
            return None
    return const, subs, descs


def finish(key):
    """Stop recording; keep the plan of problem `key` if the path was all launches through `fa_lib.launch`."""
    global _REC
    rec, _REC = _REC, None
    launch.set_recorder(None)
    if rec is None:
        return
    if rec.tainted or not any(s[0] == "launch" for s in rec.steps) or len(_PLANS) >= MAX_PLANS:
        _STATS["declined"] += 1
        return
    steps = []
    for s in rec.steps:
        if s[0] != "launch":
            steps.append(s)
            continue
        _, kernel, grid, args, kwargs, stream = s
        tmpl = _template(args, rec.slots)
        if tmpl is None:
            _STATS["declined"] += 1
            return
        entry = launch.entry(kernel, rec.device, args, kwargs)
        grid3 = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
        steps.append(("launch", kernel, grid3, tmpl, kwargs, stream, entry))
    _PLANS[key] = _Plan(steps, rec.device, len(rec.slots))
    _STATS["recorded"] += 1


class _Plan:
    """What one problem's slow path launched (see the module's docstring)."""

    __slots__ = ("steps", "device", "index", "n_slots")

    def __init__(self, steps, device, n_slots):
        self.steps = steps
        self.device = device
        self.index = device.index if device.type == "cuda" else None
        self.n_slots = n_slots

    def run(self, slots, alloc):
        """Launch the plan on this call's tensors `slots` (the recording's order, without its scratch buffers);
        `alloc(shape, dtype, device)` makes each scratch buffer."""
        if self.index is not None and torch.cuda.current_device() != self.index:
            with torch.cuda.device(self.index):
                return self.run(slots, alloc)
        _STATS["replayed"] += 1
        slots = list(slots)
        fast = current().cached_launch and not kernels.INTERPRET and launch._fast_ok()
        main = torch.cuda.current_stream(self.device) if self.index is not None else None
        for step in self.steps:
            kind = step[0]
            if kind == "launch":
                _, kernel, grid, (const, subs, descs), kwargs, stream, entry = step
                args = list(const)
                for pos, i in subs:
                    args[pos] = slots[i]
                for pos, i, desc, block, layout in descs:
                    args[pos] = desc(slots[i], block, layout)
                if fast and entry is not None and not kernel.pre_run_hooks:
                    compiled, tail = entry
                    launch._STATS["hits"] += 1
                    raw = (main if stream is None else stream).cuda_stream
                    compiled.run(grid[0], grid[1], grid[2], raw, compiled.function, compiled.packed_metadata,
                                 None, None, None, *args, *tail)
                elif stream is None:
                    launch.launch(kernel, grid, args, kwargs)
                else:
                    with torch.cuda.stream(stream):
                        launch.launch(kernel, grid, args, kwargs)
            elif kind == "alloc":
                slots.append(alloc(step[1], step[2], self.device))
            elif kind == "contig":
                slots.append(slots[step[1]].contiguous())
            else:  # "wait"
                _, waiter, waitee = step
                (main if waiter is None else waiter).wait_stream(main if waitee is None else waitee)
        return slots
