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


def test_errors_are_never_fused():
    rs = [_ar("a", 1), _ar("b", 1, error="boom"), _ar("c", 1)]
    assert fusion.plan(rs, 1000) == [[0, 2], [1]]


def test_buffer_pool_reuses():
    pool = fusion.BufferPool()
    buf = pool.take(100, torch.float32, torch.device("cpu"))
    assert buf.numel() >= 100
    pool.give(buf)
    again = pool.take(50, torch.float32, torch.device("cpu"))
    assert again.data_ptr() == buf.data_ptr()
    other = pool.take(50, torch.float64, torch.device("cpu"))
    assert other.data_ptr() != buf.data_ptr()
