"""Pairing handshake at cluster start: a prefill and a decode worker whose KV layouts
differ are refused with a message naming the field and both values, never a hang."""

from __future__ import annotations

from dataclasses import replace

import pytest
from serving import start_ray
from tiny_models import tiny_model_dir

from pdserve.cluster import Cluster, ClusterStartError
from pdserve.config import ClusterConfig

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("field, prefill_kw, decode_kw, both", [
    ("block_size", {"block_size": 16}, {"block_size": 32}, ("16", "32")),
    ("dtype", {"dtype": "float32"}, {"dtype": "bfloat16"}, ("float32", "bfloat16")),
])
def test_mismatched_layouts_refuse_to_pair(field, prefill_kw, decode_kw, both):
    start_ray()
    cfg = ClusterConfig.local(str(tiny_model_dir("llama")), port=0, prefill_blocks=32,
                              decode_blocks=32)
    cfg = replace(cfg, prefill=replace(cfg.prefill, **prefill_kw),
                  decode=replace(cfg.decode, **decode_kw))
    cluster = Cluster(cfg)
    with pytest.raises(ClusterStartError) as e:
        cluster.start()
    msg = str(e.value)
    assert "KVLayoutMismatch" in msg and field in msg and all(v in msg for v in both), msg
    assert cluster.router is None and not cluster.prefill and not cluster.decode  # torn down
