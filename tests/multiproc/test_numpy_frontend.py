"""hvdlike.numpy on 2 real ranks: every collective against a numpy oracle."""

import numpy as np

from tests.multiproc.harness import run_ranks

NP = 2


def _data(rank: int, seed: int, shape, dtype) -> np.ndarray:
    """What ``rank`` contributes; the oracle regenerates every rank's data."""
    rng = np.random.default_rng(1000 * seed + rank)
    if np.dtype(dtype) == np.bool_:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    return (rng.standard_normal(shape) * 10).astype(dtype)


def _collectives():
    import numpy as np
    import hvdlike.numpy as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    out = {}
    for dtype in ("float32", "float64", "int32", "int64", "float16", "uint8", "bool"):
        x = _data(r, 1, (3, 4), dtype)
        out[f"sum.{dtype}"] = hvd.allreduce(x, op=hvd.Sum, name=f"sum.{dtype}")
        out[f"max.{dtype}"] = hvd.allreduce(x, op=hvd.Max, name=f"max.{dtype}")
    x = _data(r, 2, (5,), "float64")
    out["avg"] = hvd.allreduce(x)
    out["scaled"] = hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0)
    # A non-contiguous, read-only view goes in without a copy and is never written.
    base = _data(r, 3, (4, 6), "float32")
    view = base[:, ::2]
    view.flags.writeable = False
    out["strided"] = hvd.allreduce(view, op=hvd.Sum)
    out["strided_untouched"] = bool(np.array_equal(view, _data(r, 3, (4, 6), "float32")[:, ::2]))
    # In place: the very same array object comes back, holding the result.
    inplace = _data(r, 4, (2, 3), "float32")
    same = hvd.allreduce_(inplace, op=hvd.Sum)
    out["inplace"] = inplace.copy()
    out["inplace_is_input"] = same is inplace
    handle = hvd.allreduce_async(_data(r, 5, (3,), "float32"), op=hvd.Min)
    out["async_min"] = hvd.synchronize(handle)
    out["polled"] = hvd.poll(handle)
    grouped = [_data(r, 6, (2,), "float32"), _data(r, 7, (3, 2), "int64")]
    out["grouped"] = hvd.grouped_allreduce(grouped, op=hvd.Sum)
    g2 = [_data(r, 8, (4,), "float64"), _data(r, 9, (1,), "float64")]
    hvd.grouped_allreduce_(g2, op=hvd.Sum)
    out["grouped_inplace"] = g2
    out["gather"] = hvd.allgather(np.full((r + 1, 2), r, dtype=np.int32))
    out["gather_scalar"] = hvd.allgather(np.float64(r + 0.5))
    out["grouped_gather"] = hvd.grouped_allgather(
        [np.arange(r + 1, dtype=np.float32), np.full((1, 3), r, dtype=np.int8)])
    out["bcast"] = hvd.broadcast(_data(r, 10, (2, 2), "float64"), root_rank=1)
    b = _data(r, 11, (3,), "int16")
    hvd.broadcast_(b, root_rank=0)
    out["bcast_inplace"] = b
    out["alltoall"] = hvd.alltoall(np.arange(4, dtype=np.float32) + 10 * r)
    splits = np.array([1, 2]) if r == 0 else np.array([2, 1])
    recv, recv_splits = hvd.alltoall(np.arange(3, dtype=np.int64) + 100 * r, splits=splits)
    out["alltoall_splits"] = (recv, recv_splits)
    out["rs"] = hvd.reducescatter(_data(r, 12, (5, 2), "float32"), op=hvd.Sum)
    out["grouped_rs"] = hvd.grouped_reducescatter(
        [_data(r, 13, (4,), "float64"), _data(r, 14, (3, 3), "float32")], op=hvd.Average)
    # Unsigned integers wider than a byte travel bit for bit (values above the
    # signed range included) and come back in their own dtype.
    for dtype in ("uint16", "uint32", "uint64"):
        top = np.iinfo(dtype).max
        wide = np.array([top - r, r, top // 2 + 1], dtype=dtype)
        out[f"wide.{dtype}"] = (hvd.broadcast(wide, root_rank=1), hvd.allgather(wide),
                                hvd.alltoall(np.array([top - r, r], dtype=dtype)))
        inplace_wide = wide.copy()
        hvd.broadcast_(inplace_wide, root_rank=0)
        out[f"wide_inplace.{dtype}"] = inplace_wide
    out["obj"] = hvd.broadcast_object({"epoch": 7} if r == 0 else None, root_rank=0)
    out["objs"] = hvd.allgather_object(("rank", r))
    hvd.barrier()
    out["join"] = hvd.join()
    hvd.shutdown()
    return out


def test_numpy_collectives_match_oracle():
    res = run_ranks(_collectives, np=NP, timeout=90)
    every = lambda seed, shape, dtype: [_data(q, seed, shape, dtype) for q in range(NP)]  # noqa
    for r, out in enumerate(res):
        for dtype in ("float32", "float64", "int32", "int64", "float16", "uint8", "bool"):
            xs = every(1, (3, 4), dtype)
            got_sum, got_max = out[f"sum.{dtype}"], out[f"max.{dtype}"]
            assert got_sum.dtype == np.dtype(dtype) and got_sum.shape == (3, 4)
            if dtype == "bool":
                np.testing.assert_array_equal(got_sum, np.logical_or(*xs))
            elif dtype == "uint8":  # wraps modulo 256 like numpy's own uint8 sum
                np.testing.assert_array_equal(got_sum, (xs[0] + xs[1]).astype(np.uint8))
            else:
                tol = 1e-2 if dtype == "float16" else 1e-6
                np.testing.assert_allclose(got_sum, xs[0] + xs[1], rtol=tol, atol=tol)
            np.testing.assert_array_equal(got_max, np.maximum(*xs))
        xs = every(2, (5,), "float64")
        np.testing.assert_allclose(out["avg"], (xs[0] + xs[1]) / 2, rtol=1e-12)
        np.testing.assert_allclose(out["scaled"], 3.0 * 0.5 * (xs[0] + xs[1]), rtol=1e-12)
        strided = [x[:, ::2] for x in every(3, (4, 6), "float32")]
        np.testing.assert_allclose(out["strided"], strided[0] + strided[1], rtol=1e-6)
        assert out["strided_untouched"]
        xs = every(4, (2, 3), "float32")
        np.testing.assert_allclose(out["inplace"], xs[0] + xs[1], rtol=1e-6)
        assert out["inplace_is_input"]
        np.testing.assert_array_equal(out["async_min"], np.minimum(*every(5, (3,), "float32")))
        assert out["polled"]
        a, b = every(6, (2,), "float32"), every(7, (3, 2), "int64")
        np.testing.assert_allclose(out["grouped"][0], a[0] + a[1], rtol=1e-6)
        np.testing.assert_array_equal(out["grouped"][1], b[0] + b[1])
        assert out["grouped"][1].dtype == np.int64
        a, b = every(8, (4,), "float64"), every(9, (1,), "float64")
        np.testing.assert_allclose(out["grouped_inplace"][0], a[0] + a[1])
        np.testing.assert_allclose(out["grouped_inplace"][1], b[0] + b[1])
        np.testing.assert_array_equal(out["gather"], [[0, 0], [1, 1], [1, 1]])
        assert out["gather"].dtype == np.int32
        np.testing.assert_array_equal(out["gather_scalar"], [0.5, 1.5])
        np.testing.assert_array_equal(out["grouped_gather"][0], [0, 0, 1])
        np.testing.assert_array_equal(out["grouped_gather"][1], [[0] * 3, [1] * 3])
        assert out["grouped_gather"][1].dtype == np.int8
        np.testing.assert_array_equal(out["bcast"], _data(1, 10, (2, 2), "float64"))
        np.testing.assert_array_equal(out["bcast_inplace"], _data(0, 11, (3,), "int16"))
        assert out["bcast_inplace"].dtype == np.int16
        sent = [np.arange(4, dtype=np.float32) + 10 * q for q in range(NP)]
        np.testing.assert_array_equal(out["alltoall"],
                                      np.concatenate([s[2 * r:2 * r + 2] for s in sent]))
        recv, recv_splits = out["alltoall_splits"]
        expect = {0: [0, 100, 101], 1: [1, 2, 102]}[r]
        np.testing.assert_array_equal(recv, expect)
        np.testing.assert_array_equal(recv_splits, [1, 2] if r == 0 else [2, 1])
        total = sum(every(12, (5, 2), "float32"))
        rows = slice(0, 3) if r == 0 else slice(3, 5)  # 5 rows: 3 on rank 0, 2 on rank 1
        np.testing.assert_allclose(out["rs"], total[rows], rtol=1e-5)
        a, b = every(13, (4,), "float64"), every(14, (3, 3), "float32")
        np.testing.assert_allclose(out["grouped_rs"][0], ((a[0] + a[1]) / 2)[2 * r:2 * r + 2])
        rows = slice(0, 2) if r == 0 else slice(2, 3)
        np.testing.assert_allclose(out["grouped_rs"][1], ((b[0] + b[1]) / 2)[rows], rtol=1e-6)
        for dtype in ("uint16", "uint32", "uint64"):
            top = np.iinfo(dtype).max
            sent = [np.array([top - q, q, top // 2 + 1], dtype=dtype) for q in range(NP)]
            bcast, gathered, exchanged = out[f"wide.{dtype}"]
            for got in (bcast, gathered, exchanged, out[f"wide_inplace.{dtype}"]):
                assert got.dtype == np.dtype(dtype)
            np.testing.assert_array_equal(bcast, sent[1])
            np.testing.assert_array_equal(gathered, np.concatenate(sent))
            np.testing.assert_array_equal(exchanged, [top - q if r == 0 else q
                                                      for q in range(NP)])
            np.testing.assert_array_equal(out[f"wide_inplace.{dtype}"], sent[0])
        assert out["obj"] == {"epoch": 7}
        assert out["objs"] == [("rank", 0), ("rank", 1)]
        assert out["join"] in (0, 1)


def _bad_input():
    import numpy as np
    import hvdlike.numpy as hvd
    import hvdlike.torch as hvd_torch
    import torch

    hvd.init()
    errors = {}

    def catch(key, fn):
        try:
            fn()
        except Exception as exc:  # record type and message for the parent to check
            errors[key] = (type(exc).__name__, str(exc))

    catch("object", lambda: hvd.allreduce(np.array([1, "a"], dtype=object)))
    catch("uint32", lambda: hvd.allreduce(np.ones(3, np.uint32)))
    catch("strings", lambda: hvd.allgather(np.array(["ab", "c"])))
    catch("list", lambda: hvd.allreduce([1.0, 2.0]))
    catch("torch", lambda: hvd.allreduce(torch.ones(2)))
    catch("readonly_inplace", lambda: hvd.allreduce_(_readonly()))
    catch("root", lambda: hvd.broadcast(np.ones(2), root_rank=5))
    catch("splits", lambda: hvd.alltoall(np.ones(3), splits=[1, 1]))
    catch("badop", lambda: hvd.allreduce(np.ones(2), op=3.5))
    catch("boolop", lambda: hvd.allreduce(np.ones(2), None, True))
    catch("adasum", lambda: hvd.allreduce(np.ones(2), op=hvd_torch.Adasum))
    # Mixing front ends on one name: torch holds "shared.<rank>" while numpy asks for
    # it; each rank's own name stays in flight until the other rank submits it too.
    mine, other = f"shared.{hvd.rank()}", f"shared.{1 - hvd.rank()}"
    handle = hvd_torch.allreduce_async(torch.ones(2), name=mine)
    catch("mixed", lambda: hvd.allreduce_async(np.ones(2), name=mine))
    released = hvd_torch.allreduce_async(torch.ones(2), name=other)
    hvd_torch.synchronize(handle)
    hvd_torch.synchronize(released)
    # After it completed, the name is free again, for any front end.
    errors["reuse"] = hvd.allreduce(np.ones(2), name="shared", op=hvd.Sum).tolist()
    # Ranks disagreeing on a dtype get the coordinator's report, then carry on.
    dtype = np.float32 if hvd.rank() == 0 else np.float64
    catch("mismatch", lambda: hvd.allreduce(np.ones(3, dtype), name="mixed.dtype"))
    errors["after"] = hvd.allreduce(np.ones(2, np.float32), op=hvd.Sum).tolist()
    hvd.shutdown()
    return errors


def _readonly():
    a = np.ones(2)
    a.flags.writeable = False
    return a


def test_numpy_bad_input_names_type_and_front_end(tmp_path):
    # The core's knobs apply unchanged: this run also records a timeline.
    trace = tmp_path / "timeline.json"
    res = run_ranks(_bad_input, np=NP, timeout=60, env={"HVDLIKE_TIMELINE": str(trace)})
    text = trace.read_text()
    assert '"allreduce.shared"' in text and "ALLREDUCE" in text and "NEGOTIATE_ALLREDUCE" in text
    for errors in res:
        kind, msg = errors["object"]
        assert kind == "TypeError" and "hvdlike.numpy.allreduce" in msg and "object" in msg
        kind, msg = errors["uint32"]
        assert kind == "TypeError" and "hvdlike.numpy.allreduce" in msg and "uint32" in msg
        assert "not reduced" in msg
        kind, msg = errors["boolop"]
        assert kind == "TypeError" and "hvdlike.numpy.allreduce" in msg and "True" in msg
        kind, msg = errors["strings"]
        assert kind == "TypeError" and "hvdlike.numpy.allgather" in msg and "<U2" in msg
        kind, msg = errors["list"]
        assert kind == "TypeError" and "numpy.ndarray" in msg and "builtins.list" in msg
        kind, msg = errors["torch"]
        assert kind == "TypeError" and "torch.Tensor" in msg and "hvdlike.torch" in msg
        kind, msg = errors["readonly_inplace"]
        assert kind == "ValueError" and "read-only" in msg and "allreduce_" in msg
        kind, msg = errors["root"]
        assert kind == "ValueError" and "hvdlike.numpy.broadcast" in msg and "root_rank 5" in msg
        kind, msg = errors["splits"]
        assert kind == "ValueError" and "hvdlike.numpy.alltoall" in msg
        kind, msg = errors["badop"]
        assert kind == "ValueError" and "unknown reduction op" in msg
        kind, msg = errors["adasum"]
        assert kind == "HvdlikeError" and "Adasum" in msg and "hvdlike.torch" in msg
        kind, msg = errors["mixed"]
        assert kind == "DuplicateNameError"
        assert "hvdlike.numpy.allreduce" in msg and "'allreduce.shared." in msg
        assert "submitted through hvdlike.torch" in msg
        assert errors["reuse"] == [2.0, 2.0]
        kind, msg = errors["mismatch"]
        assert kind == "MismatchError"
        assert "mixed.dtype" in msg and "float32" in msg and "float64" in msg
        assert errors["after"] == [2.0, 2.0]
