"""DashParams: docs/semantics.md section 1 defaults, ranges and config keys."""

import types

import pytest

from dash_core import DashParams


def test_defaults_follow_the_spec():
    p = DashParams()
    assert (p.block_size, p.topk, p.local, p.scaling_factor, p.sigma, p.estimate_diagonal, p.router) == \
        (64, None, 64, 1.0, 1e6, False, "kv_head")
    assert p.local_blocks == 1


@pytest.mark.parametrize("field,value", [
    ("block_size", 8), ("block_size", 48), ("block_size", 512), ("block_size", 64.0), ("block_size", True),
    ("topk", 0), ("topk", -3), ("topk", 2.5),
    ("local", 32), ("local", 96), ("local", 0),
    ("scaling_factor", -0.1), ("scaling_factor", float("inf")), ("scaling_factor", float("nan")),
    ("scaling_factor", "1"),
    ("sigma", 0.5), ("sigma", float("nan")),
    ("estimate_diagonal", 1), ("router", "query"),
])
def test_bad_values_name_field_value_and_range(field, value):
    with pytest.raises(ValueError) as e:
        DashParams(**{field: value})
    msg = str(e.value)
    assert field in msg and repr(value) in msg and "expected" in msg


def test_dense_equivalent():
    p = DashParams.dense_equivalent(block_size=32, local=64)
    assert (p.scaling_factor, p.estimate_diagonal, p.block_size, p.local) == (0.0, True, 32, 64)


def test_from_config_reads_published_keys_and_dash_overrides():
    cfg = {"chunk_size": 32, "scaling_factor": 4, "sigma": 4.0, "estimate_diagonal": True,
           "dash_topk": 16, "dash_local": 64, "dash_router": "shared", "hidden_size": 4096}
    p = DashParams.from_config(cfg)
    assert (p.block_size, p.scaling_factor, p.sigma, p.estimate_diagonal, p.topk, p.local, p.router) == \
        (32, 4.0, 4.0, True, 16, 64, "shared")
    # dash_<field> overrides the published key; keyword overrides win over both
    p2 = DashParams.from_config(dict(cfg, dash_scaling_factor=2.0, dash_block_size=64), topk=8)
    assert (p2.scaling_factor, p2.block_size, p2.topk, p2.local) == (2.0, 64, 8, 64)
    # an object with attributes (e.g. a HF config) works the same; absent keys keep defaults
    p3 = DashParams.from_config(types.SimpleNamespace(chunk_size=16, dash_topk=None))
    assert (p3.block_size, p3.topk, p3.local, p3.scaling_factor) == (16, None, 16, 1.0)


def test_from_config_validates():
    with pytest.raises(ValueError, match="block_size"):
        DashParams.from_config({"chunk_size": 100})


def test_attention_backend_option():
    assert DashParams().attention_backend == "TRITON"  # the default: the kernels' own attention stage
    for name in ("TRITON", "FLASH_ATTN", "FLASHINFER"):
        assert DashParams(attention_backend=name).attention_backend == name
    assert DashParams.from_config({"dash_attention_backend": "FLASHINFER"}).attention_backend == "FLASHINFER"
    with pytest.raises(ValueError) as e:
        DashParams(attention_backend="flashinfer")
    assert "attention_backend" in str(e.value) and "'flashinfer'" in str(e.value) and "FLASH_ATTN" in str(e.value)


def test_page_rope_tok_pairs():
    assert DashParams().page_rope_tok_pairs is None  # None = a quarter of the rotary dim (docs/semantics.md 9)
    assert DashParams(page_rope_tok_pairs=0).page_rope_tok_pairs == 0
    assert DashParams.from_config({"dash_page_rope_tok_pairs": 8}).page_rope_tok_pairs == 8
    for bad in (-1, 2.0, True, "8"):
        with pytest.raises(ValueError) as e:
            DashParams(page_rope_tok_pairs=bad)
        assert "page_rope_tok_pairs" in str(e.value) and repr(bad) in str(e.value)
