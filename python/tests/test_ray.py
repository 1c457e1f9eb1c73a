"""routing_replay.ray on a real Ray cluster on this machine (``ray.init`` with its cores): records
published by a rollout actor, fetched by eight trainer-rank actors (data-parallel 2 x pipeline 2 x
context-parallel 2), each rank's array equal to the one routing_replay.training builds for it from
the whole batch; the same equality over packed and padded batches, sequence parallelism, dense
layers in a stage, every final-token and padding rule; a lost object and records that do not match
their samples refused, naming the sample. Skipped, saying why, where Ray or routing_replay.wire is
not installed."""

from __future__ import annotations

import pickle
import sys
import time

import numpy as np
import pytest

try:
    import ray
except ImportError:
    pytest.skip("ray is not installed (pip install './python[ray]')", allow_module_level=True)
try:
    from routing_replay import wire
except ImportError:
    pytest.skip("routing_replay.wire is not in this build", allow_module_level=True)

from routing_replay import ray as rr_ray  # noqa: E402
from routing_replay import training as rrt  # noqa: E402

#: a small model: 6 layers, layer 1 dense, 16 experts, top-4
NUM_LAYERS, MOE_LAYERS, E, K = 6, [0, 2, 3, 4, 5], 16, 4
LAYER_MAP = rrt.LayerMap(MOE_LAYERS, NUM_LAYERS)


@pytest.fixture(scope="module")
def cluster():
    # the actors below are defined here: their code travels by value, workers need not import this file
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def routing(rng, rows: int, *, missing: int = 0) -> np.ndarray:
    """[rows, L, K] uint8 of distinct ids per row, ``missing`` rows absent (the sentinel)."""
    base = rng.integers(0, E, size=(rows, len(MOE_LAYERS), 1))
    out = ((base + np.arange(K) * (E // K)) % E).astype(np.uint8)
    if missing and rows:
        out[rng.choice(rows, size=min(missing, rows), replace=False)] = 255
    return out


def batch(seed: int, samples: int, *, short: bool = True, missing: int = 2):
    """(token counts, per-sample routing, records): about half the samples one row short."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(5, 700, size=samples).tolist()
    arrays = [routing(rng, n - 1 if short and rng.random() < 0.5 else n, missing=missing) for n in lengths]
    records = [wire.encode(a, E, layer_map=MOE_LAYERS) for a in arrays]
    return lengths, arrays, records


def reference(arrays, place: rr_ray.RankPlace, *, num_tokens=None, attention_mask=None, final_token="repeat",
              align=1, pad_rows="sentinel", dtype=None):
    """What routing_replay.training builds for the rank from the whole batch's decoded records."""
    per = len(arrays) // place.dp_size
    share = slice(place.dp_rank * per, (place.dp_rank + 1) * per)
    sp = place.sequence_parallel and place.tp_size > 1
    if attention_mask is None:
        packed = rrt.packed_batch(arrays[share], list(num_tokens)[share], final_token=final_token, align=align,
                                  pad_rows=pad_rows, dtype=dtype)
        local = rrt.megatron_token_order(packed.routing, packed=True, cu_seqlens_padded=packed.cu_seqlens_padded,
                                         cp_size=place.cp_size, cp_rank=place.cp_rank, tp_size=place.tp_size,
                                         tp_rank=place.tp_rank, sequence_parallel=sp)
    else:
        padded = rrt.padded_batch(arrays[share], np.asarray(attention_mask)[share], final_token=final_token,
                                  pad_rows=pad_rows, dtype=dtype)
        local = rrt.megatron_token_order(padded, packed=False, cp_size=place.cp_size, cp_rank=place.cp_rank,
                                         tp_size=place.tp_size, tp_rank=place.tp_rank, sequence_parallel=sp)
    return LAYER_MAP.take(local, "moe" if place.layers is None else list(place.layers))


def places_2x2x2():
    """The eight ranks of data-parallel 2 x pipeline 2 x context-parallel 2."""
    return [rr_ray.RankPlace.megatron(LAYER_MAP, pp_size=2, pp_rank=pp, dp_size=2, dp_rank=dp, cp_size=2, cp_rank=cp)
            for dp in range(2) for pp in range(2) for cp in range(2)]


@ray.remote(num_cpus=0)
class Rollout:
    """The rollout side: encodes and publishes a batch, holds (owns) its objects."""

    def publish(self, seed: int, samples: int):
        lengths, _, records = batch(seed, samples)
        return rr_ray.publish(records, samples=[f"req-{i}" for i in range(samples)])


@ray.remote(num_cpus=0)
class Rank:
    """A trainer rank: builds its routing from references, or reports the error it got."""

    def routing(self, refs, place, **kwargs):
        return rr_ray.rank_routing(refs, place, layer_map=LAYER_MAP, **kwargs)

    def error(self, refs, place, **kwargs):
        try:
            rr_ray.rank_routing(refs, place, layer_map=LAYER_MAP, **kwargs)
        except (rr_ray.RouteLostError, rr_ray.RecordMismatchError) as e:
            return type(e).__name__, str(e), e.sample
        return None

    def fetch_error(self, ref):
        """The error fetching ``ref`` raises, or the rows it gave."""
        try:
            return rr_ray.fetch(ref)
        except rr_ray.RouteLostError as e:
            return type(e).__name__, str(e), e.sample


def kill_and_wait(actor) -> None:
    """Kills an actor and returns once Ray reports it dead (ray.kill does not wait)."""
    ray.kill(actor)
    for _ in range(600):
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=10)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.05)
    raise AssertionError("the actor did not die")


def test_eight_ranks_get_their_slices(cluster):
    samples = 8
    lengths, arrays, _ = batch(11, samples)
    rollout = Rollout.remote()
    refs = ray.get(rollout.publish.remote(11, samples))
    assert len(refs) == samples and all(isinstance(r, rr_ray.RouteRef) for r in refs)
    places = places_2x2x2()
    ranks = [Rank.remote() for _ in places]
    got = ray.get([rank.routing.remote(refs, place, num_tokens=lengths, final_token="repeat", align=4,
                                       pad_rows="first_k") for rank, place in zip(ranks, places)])
    for place, g in zip(places, got):
        want = reference(arrays, place, num_tokens=lengths, final_token="repeat", align=4, pad_rows="first_k")
        assert g.dtype == want.dtype and g.shape == want.shape, place
        np.testing.assert_array_equal(g, want, err_msg=str(place))
    # the ranks of one data-parallel rank, pipeline stage and context-parallel rank partition its rows
    assert sum(g.size for g in got) == sum(reference(arrays, rr_ray.RankPlace(dp_size=2, dp_rank=d), num_tokens=lengths,
                                                     align=4, pad_rows="first_k").size for d in range(2))
    for actor in ranks + [rollout]:
        ray.kill(actor)


def test_publish_fetch_match_decode(cluster):
    lengths, arrays, records = batch(3, 4)
    refs = rr_ray.publish(records, samples=["a", "b", "c", "d"])
    for ref, record, array in zip(refs, records, arrays):
        assert len(pickle.dumps(ref)) < 1024 and len(ray.cloudpickle.dumps(ref)) < 1024
        assert (ref.num_tokens, ref.num_layers, ref.top_k, ref.num_experts, ref.token_start) == \
            (len(array), len(MOE_LAYERS), K, E, 0)
        assert ref.nbytes == len(record)
        stored = ray.get(ref.object_ref)  # the store's bytes, mapped: read-only, not a copy
        assert isinstance(stored, np.ndarray) and not stored.flags.writeable and stored.tobytes() == record
        np.testing.assert_array_equal(rr_ray.fetch(ref), wire.decode(record))
        t = len(array)
        for tokens in (slice(0, t), slice(t // 3, t), slice(t // 2, t // 2 + 1), slice(t, t)):
            for layers in (slice(0, len(MOE_LAYERS)), slice(1, 3), slice(4, 5)):
                np.testing.assert_array_equal(rr_ray.fetch(ref, tokens=tokens, layers=layers),
                                              wire.decode(record, tokens=tokens, layers=layers))
        out = np.empty((t, 2, K), dtype=np.int64)
        np.testing.assert_array_equal(rr_ray.fetch(ref, layers=slice(1, 3), out=out),
                                      wire.decode(record, layers=slice(1, 3), out=np.empty_like(out)))


@pytest.mark.parametrize("cp", [1, 2])
@pytest.mark.parametrize("sp", [1, 2])
@pytest.mark.parametrize("final_token", ["repeat", "sentinel"])
@pytest.mark.parametrize("pad_rows", ["sentinel", "first_k"])
def test_rank_routing_packed(cluster, cp, sp, final_token, pad_rows):
    lengths, arrays, records = batch(100 + cp * 10 + sp, 6)
    refs = rr_ray.publish(records)
    align = 2 * cp * sp
    layer_choices = [None, (0, 2), (2, 3, 4), (1, 2, 3), (5, 0), (1,)]  # dense layer 1 in a stage; routers out of order
    for dp in (1, 2):
        for layers in layer_choices:
            for rank in range(dp * cp * sp):
                d, c, t = rank // (cp * sp), rank // sp % cp, rank % sp
                place = rr_ray.RankPlace(layers=layers, dp_size=dp, dp_rank=d, cp_size=cp, cp_rank=c, tp_size=sp,
                                         tp_rank=t, sequence_parallel=sp > 1)
                got = rr_ray.rank_routing(refs, place, layer_map=LAYER_MAP, num_tokens=lengths,
                                          final_token=final_token, align=align, pad_rows=pad_rows)
                want = reference(arrays, place, num_tokens=lengths, final_token=final_token, align=align,
                                 pad_rows=pad_rows)
                assert got.dtype == want.dtype
                np.testing.assert_array_equal(got, want, err_msg=str(place))


@pytest.mark.parametrize("cp", [1, 2])
@pytest.mark.parametrize("sp", [1, 2])
@pytest.mark.parametrize("side", ["left", "right"])
def test_rank_routing_padded(cluster, cp, sp, side):
    lengths, arrays, records = batch(200 + cp + sp, 4)
    refs = rr_ray.publish(records)
    width = -(-max(lengths) // (2 * cp * sp)) * (2 * cp * sp)
    mask = np.zeros((len(lengths), width), dtype=np.int64)
    for b, n in enumerate(lengths):
        if side == "left":
            mask[b, width - n:] = 1
        else:
            mask[b, :n] = 1
    for dtype in (None, np.int64):
        for layers in (None, (3, 4, 5), (1, 2)):
            for c in range(cp):
                for t in range(sp):
                    place = rr_ray.RankPlace(layers=layers, dp_size=2, dp_rank=1, cp_size=cp, cp_rank=c, tp_size=sp,
                                             tp_rank=t, sequence_parallel=True)
                    got = rr_ray.rank_routing(refs, place, layer_map=LAYER_MAP, attention_mask=mask,
                                              final_token="repeat", pad_rows="first_k", dtype=dtype)
                    want = reference(arrays, place, attention_mask=mask, final_token="repeat", pad_rows="first_k",
                                     dtype=dtype)
                    assert got.dtype == want.dtype
                    np.testing.assert_array_equal(got, want, err_msg=str(place))


def test_token_start_and_megatron_place(cluster):
    rng = np.random.default_rng(5)
    rows = routing(rng, 300)
    record = wire.encode(rows, E, token_start=1000, layer_map=MOE_LAYERS)
    [ref] = rr_ray.publish([record])
    np.testing.assert_array_equal(rr_ray.fetch(ref, tokens=slice(1100, 1200)), wire.decode(record)[100:200])
    place = rr_ray.RankPlace.megatron(LAYER_MAP, pp_size=2, pp_rank=1, cp_size=2, cp_rank=1)
    assert place.layers == (3, 4, 5)
    got = rr_ray.rank_routing([ref], place, layer_map=LAYER_MAP, num_tokens=[300], final_token="refuse",
                              align=4, token_starts=[1000])
    np.testing.assert_array_equal(got, reference([rows], place, num_tokens=[300], final_token="refuse", align=4))


def test_lost_object(cluster):
    lengths, _, records = batch(11, 4)
    rollout = Rollout.remote()
    refs = ray.get(rollout.publish.remote(11, 4))
    kill_and_wait(rollout)  # the owner of the objects exits before the ranks fetch
    rank = Rank.remote()
    # Ray frees a dead owner's objects a moment after it is reported dead: until then a read may
    # still get the record (its own rows, never others), after that every read fails
    deadline = time.monotonic() + 60
    while isinstance(got := ray.get(rank.fetch_error.remote(refs[2])), np.ndarray):
        np.testing.assert_array_equal(got, wire.decode(records[2]))
        assert time.monotonic() < deadline, "the dead owner's record is still served after 60 s"
        time.sleep(0.2)
    name, message, sample = got
    assert name == "RouteLostError" and sample == "req-2"
    assert "sample 'req-2'" in message and "Re-run this sample's rollout" in message
    name, message, sample = ray.get(rank.error.remote(refs, rr_ray.RankPlace(), num_tokens=lengths,
                                                      final_token="repeat"))
    assert name == "RouteLostError" and sample in {f"req-{i}" for i in range(4)}
    with pytest.raises(rr_ray.RouteLostError, match="req-1"):
        rr_ray.fetch(refs[1])
    ray.kill(rank)


def test_mismatched_records(cluster):
    lengths, arrays, records = batch(7, 4, short=False)
    refs = rr_ray.publish(records, samples=["p", "q", "r", "s"])
    place = rr_ray.RankPlace()

    def refused(field, match, **kwargs):
        args = {"num_tokens": lengths, "final_token": "repeat", "layer_map": LAYER_MAP, **kwargs}
        with pytest.raises(rr_ray.RecordMismatchError, match=match) as e:
            rr_ray.rank_routing(args.pop("refs", refs), place, **args)
        assert e.value.field == field
        return e.value

    wrong = list(lengths)
    wrong[2] += 5  # another sample's tokens, or another turn
    e = refused("num_tokens", f"sample 'r': the record has {lengths[2]} rows for a sample of {wrong[2]} tokens",
                num_tokens=wrong)
    assert e.sample == "r"
    refused("layer_map", "sample 'p': the record's layer map", layer_map=rrt.LayerMap([0, 1, 3, 4, 5], NUM_LAYERS))
    refused("token_start", "sample 'q': the record starts at position 0, the sample's tokens at position 4",
            token_starts=[0, 4, 0, 0])
    other = wire.encode(arrays[3], E, layer_map=[0, 2, 3, 4, 1])
    refused("layer_map", "sample 's'", refs=refs[:3] + rr_ray.publish([other], samples=["s"]))
    # the remote rank reports the same
    rank = Rank.remote()
    name, message, sample = ray.get(rank.error.remote(refs, place, num_tokens=wrong, final_token="repeat"))
    assert (name, sample) == ("RecordMismatchError", "r") and "sample 'r'" in message
    ray.kill(rank)
    with pytest.raises(ValueError, match="final_token='refuse'"):
        short = wire.encode(arrays[0][:-1], E, layer_map=MOE_LAYERS)
        rr_ray.rank_routing(rr_ray.publish([short]), place, layer_map=LAYER_MAP, num_tokens=lengths[:1],
                            final_token="refuse")
    with pytest.raises(ValueError, match="does not split evenly over 3 data-parallel"):
        rr_ray.rank_routing(refs, rr_ray.RankPlace(dp_size=3), layer_map=LAYER_MAP, num_tokens=lengths,
                            final_token="repeat")
    with pytest.raises(TypeError, match="bytes routing_replay.wire.encode returns"):
        rr_ray.publish([arrays[0].tolist()])


def test_rank_decodes_only_its_rows_and_layers(cluster, monkeypatch):
    lengths, arrays, records = batch(9, 4, short=False, missing=0)
    refs = rr_ray.publish(records)
    calls = []
    decode = wire.decode

    def spy(record, *, tokens=None, layers=None, out=None):
        calls.append((tokens, layers))
        return decode(record, tokens=tokens, layers=layers, out=out)

    monkeypatch.setattr(rr_ray.wire, "decode", spy)
    place = rr_ray.RankPlace.megatron(LAYER_MAP, pp_size=2, pp_rank=1, dp_size=2, dp_rank=0, cp_size=2, cp_rank=0)
    got = rr_ray.rank_routing(refs, place, layer_map=LAYER_MAP, num_tokens=lengths, final_token="repeat", align=4)
    # one decode per context-parallel chunk of each of the rank's two samples, its stage's layers only
    assert len(calls) <= 4 and all(layers == slice(2, 5) for _, layers in calls)
    assert sum(t.stop - t.start for t, _ in calls) <= len(got)

