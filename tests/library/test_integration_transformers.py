"""fa_lib.integrations.transformers: attn_implementation="fa_lib" in HuggingFace transformers models.

Tiny random models (2 layers, hidden size 64, 4 query heads and 2 key/value heads of dim 16, vocabulary
128) built from a config with a fixed seed in float32; the same weights are loaded twice, once with
transformers' own "sdpa" (or "eager", for Gemma 2's softcap, which sdpa refuses) and once with "fa_lib",
and compared: logits, loss and every parameter's gradient; left- and right-padded batches at the real
tokens; greedy `generate` with a KV cache (dynamic and static), token for token. fa_lib's float32 kernels
compute with exact float32 products, so the two agree to ~1e-6. No network: no `from_pretrained`.
"""
import copy
import importlib
import os
import subprocess
import sys

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers (and huggingface_hub) is imported
os.environ["TRANSFORMERS_OFFLINE"] = "1"
transformers = pytest.importorskip("transformers")
from transformers import masking_utils  # noqa: E402

import fa_lib.integrations.transformers as fa_hf  # noqa: E402

ATOL, RTOL = 2e-5, 2e-5
SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16)


@pytest.fixture(scope="module", autouse=True)
def registered():
    fa_hf.register()


def _pair(cls, config, ref="sdpa", seed=0):
    """(reference model, fa_lib model) with the same random weights, in eval mode."""
    torch.manual_seed(seed)
    ref_model = cls._from_config(copy.deepcopy(config), attn_implementation=ref, dtype=torch.float32).eval()
    fa_model = cls._from_config(copy.deepcopy(config), attn_implementation="fa_lib", dtype=torch.float32).eval()
    fa_model.load_state_dict(ref_model.state_dict())
    assert ref_model.config._attn_implementation == ref and fa_model.config._attn_implementation == "fa_lib"
    return ref_model, fa_model


def _batch(b=2, n=12, pad=None, seed=1):
    """Token ids and a 2-D attention mask; `pad`: None, "left" or "right" (rows padded by 3 and 5)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (b, n), generator=g)
    mask = torch.ones(b, n, dtype=torch.long)
    for row, p in zip(range(b), (3, 5)):
        if pad == "left":
            mask[row, :p] = 0
        elif pad == "right":
            mask[row, n - p:] = 0
    return ids, mask


@pytest.fixture(scope="module")
def llama():
    return _pair(transformers.LlamaForCausalLM, transformers.LlamaConfig(**SMALL))


@pytest.fixture(scope="module")
def mistral():
    return _pair(transformers.MistralForCausalLM, transformers.MistralConfig(**SMALL, sliding_window=4))


def _logits(model, ids, mask):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


def _assert_generate_equal(ref_model, fa_model, ids, mask, **kw):
    args = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, output_scores=True,
                return_dict_in_generate=True, pad_token_id=0, **kw)
    a, b = ref_model.generate(ids, **args), fa_model.generate(ids, **args)
    assert torch.equal(a.sequences, b.sequences), (a.sequences, b.sequences)
    for sa, sb in zip(a.scores, b.scores):
        torch.testing.assert_close(sb, sa, atol=ATOL, rtol=RTOL)


# ---------------------------------------------------------------------------------------------------
# Llama (causal, GQA): logits, loss, gradients, padding, generate.
# ---------------------------------------------------------------------------------------------------
def test_llama_logits_loss_and_gradients(llama):
    ref_model, fa_model = llama
    ids, _ = _batch(n=16)
    results = []
    for model in (ref_model, fa_model):
        model.train()  # attention_dropout is 0.0: training mode, no dropout
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        results.append((out.logits.detach(), out.loss.detach(),
                        {n: p.grad for n, p in model.named_parameters()}))
        model.eval()
    (la, lossa, ga), (lb, lossb, gb) = results
    torch.testing.assert_close(lb, la, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(lossb, lossa, atol=ATOL, rtol=RTOL)
    assert ga.keys() == gb.keys()
    for name in ga:
        assert gb[name] is not None, name
        torch.testing.assert_close(gb[name], ga[name], atol=ATOL, rtol=RTOL, msg=name)


@pytest.mark.parametrize("pad", ["left", "right"])
def test_llama_padded_batch(llama, pad):
    ref_model, fa_model = llama
    ids, mask = _batch(pad=pad)
    a, b = _logits(ref_model, ids, mask), _logits(fa_model, ids, mask)
    real = mask.bool()
    torch.testing.assert_close(b[real], a[real], atol=ATOL, rtol=RTOL)
    assert torch.isfinite(b).all()  # padding rows too: a query that sees no key gives 0, not NaN


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_llama_generate_with_kv_cache(llama, cache):
    ref_model, fa_model = llama
    ids, mask = _batch(pad="left")
    _assert_generate_equal(ref_model, fa_model, ids, mask, cache_implementation=cache)


def test_attention_function_alone_gets_no_mask(llama):
    """The bug that the mask function prevents: registered alone, the attention function receives
    attention_mask=None, and a left-padded batch attends to its padding."""
    ref_model, _ = llama
    transformers.AttentionInterface.register("fa_lib_nomask", fa_hf.fa_lib_attention_forward)
    try:
        nomask = copy.deepcopy(ref_model)
        nomask.set_attn_implementation("fa_lib_nomask")
        ids, mask = _batch(pad="left")
        a, b = _logits(ref_model, ids, mask), _logits(nomask, ids, mask)
        assert (a - b)[mask.bool()].abs().max() > 1e-3
    finally:
        transformers.AttentionInterface._global_mapping.pop("fa_lib_nomask", None)
    assert masking_utils.AttentionMaskInterface._global_mapping["fa_lib"] is fa_hf.fa_lib_mask


# ---------------------------------------------------------------------------------------------------
# Sliding window (Mistral) and softcap + alternating sliding/full layers (Gemma 2).
# ---------------------------------------------------------------------------------------------------
def test_mistral_sliding_window(mistral):
    ref_model, fa_model = mistral
    ids, mask = _batch(pad="left")
    a, b = _logits(ref_model, ids, mask), _logits(fa_model, ids, mask)
    real = mask.bool()
    torch.testing.assert_close(b[real], a[real], atol=ATOL, rtol=RTOL)
    # the window matters at this size: without it the logits differ
    full = copy.deepcopy(ref_model)
    full.config.sliding_window = None
    for layer in full.model.layers:
        layer.self_attn.config.sliding_window = None
    assert (_logits(full, ids, mask) - a)[real].abs().max() > 1e-3
    _assert_generate_equal(ref_model, fa_model, ids, mask)  # a sliding-window cache


def test_gemma2_softcap_and_sliding_window():
    config = transformers.Gemma2Config(**SMALL, sliding_window=4, attn_logit_softcapping=2.0)
    assert config.layer_types == ["sliding_attention", "full_attention"]
    ref_model, fa_model = _pair(transformers.Gemma2ForCausalLM, config, ref="eager")
    ids, mask = _batch(pad="left")
    a, b = _logits(ref_model, ids, mask), _logits(fa_model, ids, mask)
    real = mask.bool()
    torch.testing.assert_close(b[real], a[real], atol=ATOL, rtol=RTOL)
    _assert_generate_equal(ref_model, fa_model, ids, mask)


def test_gpt_oss_sinks_and_sliding_window():
    """gpt-oss: a learnable sink logit per head (``s_aux``) and alternating sliding/full layers; logits, loss and
    the sinks' gradients as transformers' eager attention computes them."""
    config = transformers.GptOssConfig(**{**SMALL, "intermediate_size": 64}, num_local_experts=4,
                                       num_experts_per_tok=2, sliding_window=4,
                                       layer_types=["sliding_attention", "full_attention"])
    ref_model, fa_model = _pair(transformers.GptOssForCausalLM, config, ref="eager")
    with torch.no_grad():  # sinks that matter: the initialised ones are zeros or random, either way set them
        for m in (ref_model, fa_model):
            for i, layer in enumerate(m.model.layers):
                layer.self_attn.sinks.copy_(torch.linspace(-1.0, 2.0, layer.self_attn.sinks.numel()) + i)
    ids, mask = _batch(pad="left")
    real = mask.bool()
    a, b = _logits(ref_model, ids, mask), _logits(fa_model, ids, mask)
    torch.testing.assert_close(b[real], a[real], atol=ATOL, rtol=RTOL)
    ids, _ = _batch()
    for m in (ref_model, fa_model):
        m.train()
        m(input_ids=ids, labels=ids).loss.backward()
    for ra, fa in zip(ref_model.model.layers, fa_model.model.layers):
        torch.testing.assert_close(fa.self_attn.sinks.grad, ra.self_attn.sinks.grad, atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------------------------------------------
# What raises.
# ---------------------------------------------------------------------------------------------------
def test_dropout_in_training_raises():
    config = transformers.LlamaConfig(**{**SMALL, "num_hidden_layers": 1}, attention_dropout=0.1)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="fa_lib").train()
    ids, _ = _batch()
    with pytest.raises(ValueError, match="dropout"):
        model(input_ids=ids)
    model.eval()  # eval mode passes dropout=0.0: fine
    model(input_ids=ids)


def test_output_attentions_raises(llama):
    _, fa_model = llama
    ids, mask = _batch()
    with pytest.raises(ValueError, match="output_attentions"):
        fa_model(input_ids=ids, attention_mask=mask, output_attentions=True)


def test_packed_sequences_raise(llama):
    """Two sequences packed in one row (position_ids restart, no attention_mask, no cache): sdpa's mask
    keeps them apart; fa_lib's mask function refuses rather than attending across them."""
    _, fa_model = llama
    ids, _ = _batch(b=1)
    position_ids = torch.cat([torch.arange(5), torch.arange(7)])[None]
    with pytest.raises(ValueError, match="packed sequences"):
        fa_model(input_ids=ids, position_ids=position_ids, use_cache=False)  # no cache: as in training


def test_unsupported_mask_functions_raise():
    custom = masking_utils.and_masks(masking_utils.causal_mask_function, lambda b, h, q, kv: kv % 2 == 0)
    chunked = masking_utils.chunked_causal_mask_function(4, torch.zeros(1, dtype=torch.long))
    for fn in (custom, chunked):
        with pytest.raises(ValueError, match="cannot express"):
            fa_hf.fa_lib_mask(batch_size=1, q_length=8, kv_length=8, mask_function=fn)


def test_contradicting_or_ambiguous_layer_arguments_raise():
    q, k, v = _qkv()
    causal = fa_hf.fa_lib_mask(batch_size=2, q_length=8, kv_length=8)  # full causal, no window
    with pytest.raises(ValueError, match="contradicts"):
        fa_hf.fa_lib_attention_forward(_Layer(), q, k, v, causal, sliding_window=3)
    fa_hf.fa_lib_attention_forward(_Layer(), q, k, v, causal, sliding_window=8)  # wider than the sequence: same
    q, k, v = _qkv(nq=4, nk=8)  # no mask, causal, seqlen_q != seqlen_k: top-left or bottom-right?
    with pytest.raises(ValueError, match="ambiguous"):
        fa_hf.fa_lib_attention_forward(_Layer(), q, k, v, None)


def test_register_checks_its_name():
    with pytest.raises(ValueError, match="name"):
        fa_hf.register("my_flash")
    with pytest.raises(TypeError, match="name"):
        fa_hf.register(1)


# ---------------------------------------------------------------------------------------------------
# The mask function and the attention function, called directly.
# ---------------------------------------------------------------------------------------------------
def _qkv(b=2, hq=4, hkv=2, nq=8, nk=8, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, hq, nq, d, generator=g), torch.randn(b, hkv, nk, d, generator=g),
            torch.randn(b, hkv, nk, d, generator=g))


def _dense_attention(q, k, v, visible):
    """softmax over the visible keys, in float64; rows with no visible key give 0. visible: (B, Nq, Nk)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1).double(), v.repeat_interleave(rep, 1).double()
    s = (q.double() @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    s = s.masked_fill(~visible[:, None], float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return (p @ v).transpose(1, 2)


class _Layer(torch.nn.Module):
    is_causal = True


def test_mask_and_attention_functions_on_offsets():
    """A chunk of 3 queries after 5 cached tokens, left padding of 2, a static cache of 12 slots: the mask
    that sdpa_mask builds, and fa_lib's, row by row; padding query rows give exactly 0."""
    b, nq, q_offset, kv_length = 2, 3, 5, 12
    pad2d = torch.ones(b, q_offset + nq, dtype=torch.bool)
    pad2d[1, :2] = False
    for fn in (masking_utils.causal_mask_function, masking_utils.sliding_window_causal_mask_function(3)):
        kw = dict(batch_size=b, q_length=nq, kv_length=kv_length, q_offset=q_offset, kv_offset=0,
                  mask_function=fn, attention_mask=pad2d)
        dense = masking_utils.sdpa_mask(**kw, allow_is_causal_skip=False)[:, 0]
        mask = fa_hf.fa_lib_mask(**kw)
        assert mask.num_keys == q_offset + nq  # the static cache's unwritten slots are dropped
        q, k, v = _qkv(b=b, nq=nq, nk=kv_length)
        out, weights = fa_hf.fa_lib_attention_forward(_Layer(), q, k, v, mask)
        assert weights is None and out.shape == (b, nq, 4, 16)
        torch.testing.assert_close(out.double(), _dense_attention(q, k, v, dense), atol=1e-5, rtol=1e-5)
    # left padding without a cache: padding queries see only padding keys
    pad2d = torch.ones(b, 8, dtype=torch.bool)
    pad2d[0, :3] = False
    mask = fa_hf.fa_lib_mask(batch_size=b, q_length=8, kv_length=8, attention_mask=pad2d)
    q, k, v = _qkv(b=b)
    out, _ = fa_hf.fa_lib_attention_forward(_Layer(), q, k, v, mask)
    assert torch.equal(out[0, :3], torch.zeros_like(out[0, :3]))


def test_value_head_dim_unlike_query():
    """MLA-style value heads, narrower and wider than the query's: the same as a dense softmax."""
    n = 6
    visible = torch.ones(1, n, n, dtype=torch.bool).tril()
    for dv in (8, 24):
        q, k, _ = _qkv(b=1, nq=n, nk=n)
        v = torch.randn(1, 2, n, dv, generator=torch.Generator().manual_seed(3))
        out, _ = fa_hf.fa_lib_attention_forward(_Layer(), q, k, v, fa_hf.fa_lib_mask(1, n, n))
        assert out.shape == (1, n, 4, dv)
        torch.testing.assert_close(out.double(), _dense_attention(q, k, v, visible), atol=1e-5, rtol=1e-5)


def test_dense_4d_masks():
    """A 4-D mask (bool or 0/-inf float) is accepted when it equals causal + key padding (checked
    exactly); a float mask with any other value (an additive bias) raises."""
    b, n = 2, 8
    pad2d = torch.ones(b, n, dtype=torch.bool)
    pad2d[0, :3] = False
    kw = dict(batch_size=b, q_length=n, kv_length=n, attention_mask=pad2d)
    q, k, v = _qkv(b=b)
    want, _ = fa_hf.fa_lib_attention_forward(_Layer(), q, k, v, fa_hf.fa_lib_mask(**kw))
    for dense in (masking_utils.sdpa_mask(**kw, allow_is_causal_skip=False),
                  masking_utils.eager_mask(**kw, dtype=torch.float32)):
        got, _ = fa_hf.fa_lib_attention_forward(_Layer(), q, k, v, dense)
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    biased = masking_utils.eager_mask(**kw, dtype=torch.float32) + 0.5 * torch.rand(b, 1, n, n)
    with pytest.raises(ValueError, match="additive"):
        fa_hf.fa_lib_attention_forward(_Layer(), q, k, v, biased)
    kpm = pad2d.to(torch.long)  # a 2-D key padding mask, with the layer's is_causal
    got, _ = fa_hf.fa_lib_attention_forward(_Layer(), q, k, v, kpm)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    holes = masking_utils.sdpa_mask(**kw, allow_is_causal_skip=False).clone()
    holes[1, 0, 5, 2] = False  # not causal + padding any more
    with pytest.raises(ValueError, match="cannot express"):
        fa_hf.fa_lib_attention_forward(_Layer(), q, k, v, holes)


# ---------------------------------------------------------------------------------------------------
# Imports.
# ---------------------------------------------------------------------------------------------------
def test_import_fa_lib_does_not_import_transformers():
    code = ("import sys, fa_lib, fa_lib.integrations; fa_lib.flash_attention; "
            "assert 'transformers' not in sys.modules, 'transformers imported'")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


def test_register_without_transformers(monkeypatch):
    import fa_lib.integrations

    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now fails
    monkeypatch.delitem(sys.modules, "fa_lib.integrations.transformers")
    monkeypatch.setattr(fa_lib.integrations, "transformers", fa_hf)  # put back after the test, as sys.modules
    module = importlib.import_module("fa_lib.integrations.transformers")
    assert module is not fa_hf
    with pytest.raises(ImportError, match="pip install transformers"):
        module.register()
