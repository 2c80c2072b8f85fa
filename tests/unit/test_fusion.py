import torch

from hvdlike.core import fusion
from hvdlike.core.messages import OpType, ReduceOp, Response


def _ar(name, n, dtype="float32", op=ReduceOp.SUM, **kw):
    return Response(name=name, op=OpType.ALLREDUCE, dtype=dtype, shape=(n,), reduce_op=op, **kw)


def test_packs_up_to_threshold_in_order():
    rs = [_ar(f"t{i}", 10) for i in range(5)]  # 40 bytes each
    assert fusion.plan(rs, 100) == [[0, 1], [2, 3], [4]]
    assert fusion.plan(rs, 1 << 20) == [[0, 1, 2, 3, 4]]


def test_zero_threshold_disables_fusion():
    rs = [_ar(f"t{i}", 10) for i in range(3)]
    assert fusion.plan(rs, 0) == [[0], [1], [2]]


def test_oversized_tensor_alone_and_keys_separate():
    rs = [_ar("a", 10), _ar("huge", 1000), _ar("b", 10, dtype="float64"), _ar("c", 10),
          _ar("d", 10, op=ReduceOp.MAX), _ar("e", 10, postscale=0.5),
          Response(name="g", op=OpType.ALLGATHER, dtype="float32", shape=(3,))]
    batches = fusion.plan(rs, 200)
    assert [0, 3] in batches
    assert [1] in batches and [2] in batches and [4] in batches and [5] in batches
    assert [6] in batches
    assert sorted(i for b in batches for i in b) == list(range(7))


def test_tensors_a_plane_reduces_in_place_stay_out_of_fusion_buffers():
    # 400-byte tensors on the CPU are alone from 400 bytes on (the shared-memory
    # plane reads them across); the same sizes on another device still fuse.
    rs = [_ar("a", 10), _ar("big", 100), _ar("b", 10), _ar("big2", 150),
          _ar("c", 99), _ar("cuda.big", 100, device="cuda"), _ar("cuda.small", 10, device="cuda")]
    assert fusion.plan(rs, 4096, alone={"cpu": 400}) == [[0, 2, 4], [1], [3], [5, 6]]
    assert fusion.plan(rs, 4096) == [[0, 1, 2, 3, 4], [5, 6]]
    assert fusion.plan(rs, 4096, alone={"cuda": 400}) == [[0, 1, 2, 3, 4], [5], [6]]
    assert fusion.plan(rs, 0, alone={"cpu": 400}) == [[i] for i in range(7)]


def test_fusion_classes_match_keys_exactly_once_the_class_table_is_full(monkeypatch):
    # Classes are numbers for the first keys seen; later keys stand for
    # themselves. Equal keys fuse and unequal ones do not either way, so the
    # plan does not depend on which keys a rank happened to see first.
    from hvdlike.core import messages

    monkeypatch.setattr(messages, "_FUSION_CLASSES", {})
    monkeypatch.setattr(messages, "_FUSION_CLASSES_MAX", 2)
    rs = [_ar(f"s{i}", 10, postscale=1.0 + i) for i in range(5)]  # five keys
    classes = [r.fusion_terms[0] for r in rs]
    assert len(set(classes)) == 5
    assert all(isinstance(c, int) for c in classes[:2])
    assert classes[2:] == [r.fusion_key() for r in rs[2:]]
    assert len(messages._FUSION_CLASSES) == 2
    twins = [_ar("t0", 10, postscale=1.0), _ar("t4", 10, postscale=5.0)]  # rs[0]'s, rs[4]'s keys
    assert fusion.plan([rs[0], rs[4], twins[0], twins[1]], 1 << 20) == [[0, 2], [1, 3]]
    assert fusion.plan(rs, 1 << 20) == [[0], [1], [2], [3], [4]]
    assert _ar("bf", 3, dtype="bfloat16").fusion_terms[1] == 6
    assert _ar("b", 3, dtype="bool").fusion_terms[1] == 3


def test_errors_are_never_fused():
    rs = [_ar("a", 1), _ar("b", 1, error="boom"), _ar("c", 1)]
    assert fusion.plan(rs, 1000) == [[0, 2], [1]]


def test_disable_group_fusion_keeps_each_group_to_itself():
    rs = [_ar("a", 10), _ar("g.0", 10, group="g"), _ar("b", 10), _ar("g.1", 10, group="g"),
          _ar("h.0", 10, group="h"), _ar("h.1", 10, group="h")]
    assert fusion.plan(rs, 1 << 20) == [[0, 1, 2, 3, 4, 5]]  # the default: all fuse
    assert fusion.plan(rs, 1 << 20, separate_groups=True) == [[0, 2], [1, 3], [4, 5]]
    # The threshold still caps a group's batch.
    assert fusion.plan(rs, 80, separate_groups=True) == [[0, 2], [1, 3], [4, 5]]
    assert fusion.plan(rs, 40, separate_groups=True) == [[0], [1], [2], [3], [4], [5]]


def test_runtime_settings_carry_disable_group_fusion():
    from hvdlike.core import config, runtime, topology

    topo = topology.Topology(hostname="h")
    for env, expected in (({}, False), ({"HOROVOD_DISABLE_GROUP_FUSION": "1"}, True),
                          ({"HVDLIKE_DISABLE_GROUP_FUSION": "true"}, True)):
        rt = runtime.Runtime(config.load(env), topo, rendezvous=None)
        assert rt.settings.separate_groups is expected, env


def test_buffer_pool_reuses():
    pool = fusion.BufferPool()
    buf = pool.take(100, torch.float32, torch.device("cpu"))
    assert buf.numel() >= 100
    pool.give(buf)
    again = pool.take(50, torch.float32, torch.device("cpu"))
    assert again.data_ptr() == buf.data_ptr()
    other = pool.take(50, torch.float64, torch.device("cpu"))
    assert other.data_ptr() != buf.data_ptr()
