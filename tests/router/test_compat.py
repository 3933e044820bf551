"""Which prefill/decode workers the router may pair (model, dtype, KV layout)."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.router.compat import Identity, incompatible

A = Identity("m", "bfloat16", "L1")


@dataclass
class W:
    url: str
    role: str
    identity: Identity | None
    is_healthy: bool = True


def test_mismatch_names_every_differing_field():
    assert A.mismatch(A) is None
    reason = A.mismatch(Identity("other", "float16", "L2"))
    assert reason is not None
    for word in ("model", "dtype", "kv_layout", "'float16'", "'L2'"):
        assert word in reason


def test_unpublished_dtype_and_layout_match_anything_but_the_model_must_agree():
    assert A.mismatch(Identity("m", "", "")) is None
    assert Identity("m", "", "").mismatch(A) is None
    assert Identity("x", "", "").mismatch(A) is not None


def test_the_odd_worker_out_is_refused_whatever_its_role_or_arrival():
    odd = Identity("m", "float16", "L1")
    for first in ("prefill", "decode"):
        workers = [W("http://odd:1", first, odd), W("http://p:1", "prefill", A)]
        workers += [W("http://d:1", "decode", A), W("http://d:2", "decode", A)]
        out = incompatible(workers)
        assert list(out) == ["http://odd:1"]
        assert "dtype 'float16' != 'bfloat16'" in out["http://odd:1"]


def test_one_architecture_with_other_weights_is_not_paired():
    tuned = Identity("m", "bfloat16", "L1", weights="w-tuned")
    base = Identity("m", "bfloat16", "L1", weights="w-base")
    assert "weights 'w-tuned' != 'w-base'" in (tuned.mismatch(base) or "")
    workers = [W("http://p:1", "prefill", base), W("http://d:1", "decode", base)]
    workers.append(W("http://d:2", "decode", tuned))
    assert list(incompatible(workers)) == ["http://d:2"]
    assert Identity("m", "bfloat16", "L1").mismatch(base) is None  # not published: any


def test_a_tie_keeps_the_first_registered_and_refuses_the_other():
    workers = [W("http://p:1", "prefill", A), W("http://d:1", "decode", Identity("b", "", ""))]
    assert list(incompatible(workers)) == ["http://d:1"]


def test_colocated_unknown_and_unhealthy_workers_do_not_set_the_reference():
    other = Identity("b", "bfloat16", "L1")
    workers = [
        W("http://c:1", "colocated", other),
        W("http://u:1", "prefill", None),
        W("http://sick:1", "decode", other, is_healthy=False),
        W("http://p:1", "prefill", A),
        W("http://d:1", "decode", A),
    ]
    # The sick decode is judged (it must not be paired when it recovers) but sets nothing.
    assert list(incompatible(workers)) == ["http://sick:1"]
    assert incompatible([W("http://sick:1", "decode", A, is_healthy=False)]) == {}
