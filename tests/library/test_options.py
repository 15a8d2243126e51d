"""fa_lib.kernel_options: scoped, thread-local overrides of the kernel choice, checked when the block is entered."""
import threading

import pytest
import torch

import fa_lib
from fa_lib import options


def test_defaults_and_a_scoped_override():
    assert options.current() is options.DEFAULT and options.DEFAULT.hopper_forward == "auto"
    with fa_lib.kernel_options(hopper_forward="never", split_head_dim={96, 80}) as opts:
        assert options.current() is opts and opts.hopper_forward == "never"
        assert opts.split_head_dim == frozenset({80, 96}) and opts.hopper_backward == "auto"
        with fa_lib.kernel_options(plans=False):  # nested: the outer block's options stay
            assert options.current().hopper_forward == "never" and not options.current().plans
        assert options.current() is opts
    assert options.current() is options.DEFAULT


def test_equal_options_are_one_object():
    # a launch plan's key holds the options by identity: equal sets must be the same object
    with fa_lib.kernel_options(prefill_split={64: (True,)}) as a:
        pass
    with fa_lib.kernel_options(prefill_split=((64, (True,)),)) as b:
        pass
    assert a is b and a.prefill_split_masks(64) == (True,) and a.prefill_split_masks(128) == ()


@pytest.mark.parametrize("overrides, match", [
    (dict(hopper_fwd="never"), "unknown kernel option 'hopper_fwd'"),
    (dict(hopper_forward="off"), "hopper_forward must be one of"),
    (dict(hopper_dq=[]), "hopper_dq must be one of"),
    (dict(one_pass_backward=3), "one_pass_backward must be"),
    (dict(one_pass_backward=True), "one_pass_backward must be"),
    (dict(split_head_dim="yes"), "split_head_dim must be True, False or a set of head dims"),
    (dict(prefill_split={64: True}), "prefill_split must be a dict"),
    (dict(plans=1), "plans must be True or False"),
])
def test_a_bad_option_is_a_value_error_naming_it(overrides, match):
    with pytest.raises(ValueError, match=match):
        with fa_lib.kernel_options(**overrides):
            pass
    assert options.current() is options.DEFAULT


def test_using_takes_kernel_options_only():
    with pytest.raises(TypeError, match="opts must be a fa_lib.options.KernelOptions, got dict"):
        with options.using({"plans": False}):
            pass


def test_options_are_per_thread():
    seen = {}
    with fa_lib.kernel_options(decode_pdl=True):
        t = threading.Thread(target=lambda: seen.update(other=options.current().decode_pdl))
        t.start()
        t.join()
        seen["this"] = options.current().decode_pdl
    assert seen == {"this": True, "other": False}


def test_a_backward_runs_under_its_forwards_options(monkeypatch):
    from fa_lib import ops

    seen = []
    real = ops._backward_flat

    def spy(*args, **kwargs):
        seen.append(options.current().split_head_dim)
        return real(*args, **kwargs)

    monkeypatch.setattr(ops, "_backward_flat", spy)
    q = torch.randn(1, 2, 9, 16, requires_grad=True)
    with fa_lib.kernel_options(split_head_dim=False):
        o = fa_lib.flash_attention(q, q, q, causal=True)
    o.sum().backward()  # outside the block
    assert seen == [False]
