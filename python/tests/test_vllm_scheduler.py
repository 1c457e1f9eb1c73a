"""vLLM 0.33's own ``Scheduler`` (and ``AsyncScheduler``) driving its own routed-experts worker
connector and, in a second run of the same trace, routing_replay.vllm's: every step's outputs and
the final ``routed_experts`` of every request must be equal. Needs an installed vLLM 0.33 (skips,
saying so, without one); runs on the CPU.

The engine is vLLM's where it can be without a model: a real ``VllmConfig`` (its ``ModelConfig``
read from a small Qwen3-MoE config.json, no weights), the scheduler class that config picks, vLLM's
KV cache manager, prefix caching and chunked prefill, its ``AuxOutputSchedulerConnector`` building
the metadata, vLLM's ``bind_routed_experts_capturer`` binding the connector's capturer to the
model's capture sources. The model runner is restated: it keeps each request's tokens and computed
positions as the device would, computes routing as a function of a position's token prefix (so that
a prefix hit reads back what the first request filed), samples tokens and accepts or rejects drafts
from a seeded generator, and calls the connector as vLLM's GPU model runner does (``begin_step``
before the forward, even for an empty step; capture per layer; ``prepare_output``,
``enqueue_cpu_copy``, ``process_output``). The engine loop is EngineCore's: ``schedule``, execute,
``update_from_output``, drafts through ``update_draft_token_ids``; under asynchronous scheduling the
next step is scheduled and run before the previous one's output is processed (its batch queue).
What crosses processes in vLLM crosses here the same way: the scheduler output to the worker and
the model runner output back by pickle, the engine-core outputs to the front end through vLLM's
msgpack encoder and decoder.

Setups (each with eight seeds): synchronous scheduling with three drafts per decode step, accepted
at random; asynchronous scheduling (two steps in flight) without drafts, with two drafts (the
scheduler runs ahead of the device past rejected drafts still in flight), and with small batches.
All have long prompts split into chunks, requests sharing prompt prefixes with requests that ran
before (prefix hits read from the store), a routed-experts prompt start past 0 for some, stop
tokens and max_tokens, and requests that stop with a step of theirs in flight.
"""

from __future__ import annotations

import json
import pickle
from dataclasses import dataclass

import numpy as np
import pytest

from _peers import load_vllm_peer, vllm_peer_choice
from _vllm_harness import have_library
from _vllm_scheduler import _mix, content_hash

_KIND, _WHY = vllm_peer_choice()
if _KIND != "installed":
    pytest.skip(f"peer vLLM 0.33 (its Scheduler) is not in use: {_WHY}", allow_module_level=True)
if not have_library():
    pytest.skip("routing_replay.vllm is not built here", allow_module_level=True)

import torch  # noqa: E402  (vLLM's dependency)

installed = load_vllm_peer()  # _vllm_installed: the one-rank setup, the configs of the KV cache
import routing_replay.vllm as library  # noqa: E402
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, SpeculativeConfig, VllmConfig  # noqa: E402
from vllm.config.aux_output import AuxOutputConfig  # noqa: E402
from vllm.distributed.aux_output_connector.worker import AuxOutputWorkerConnector  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.engine import EngineCoreOutputs  # noqa: E402
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

LAYERS, EXPERTS, TOP_K = 3, 8, 2
BLOCK = 4
STOP_TOKEN = 7
NUM_KV_BLOCKS = 96


@dataclass(frozen=True)
class Setup:
    name: str
    async_scheduling: bool
    num_spec: int
    max_num_batched_tokens: int = 24
    max_num_seqs: int = 4


SETUPS = [Setup("sync-spec3", False, 3), Setup("async", True, 0), Setup("async-spec2", True, 2),
          Setup("async-small-batches", True, 0, 12, 3)]
SEEDS = range(8)


@pytest.fixture(scope="module")
def model_config(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_moe")
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 64,
        "intermediate_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": LAYERS,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": EXPERTS,
        "num_experts_per_tok": TOP_K, "vocab_size": 1000, "max_position_embeddings": 4096,
        "torch_dtype": "bfloat16", "decoder_sparse_step": 1, "mlp_only_layers": []}))
    return ModelConfig(model=str(folder), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=2048)


def vllm_config(model_config, setup: Setup) -> VllmConfig:
    spec = None
    if setup.num_spec:
        spec = SpeculativeConfig(method="ngram", num_speculative_tokens=setup.num_spec, prompt_lookup_max=3,
                                 prompt_lookup_min=2)
    return VllmConfig(model_config=model_config, cache_config=CacheConfig(block_size=BLOCK),
                      scheduler_config=SchedulerConfig(max_num_batched_tokens=setup.max_num_batched_tokens,
                                                       max_num_seqs=setup.max_num_seqs, max_model_len=2048,
                                                       is_encoder_decoder=False, enable_chunked_prefill=True,
                                                       async_scheduling=setup.async_scheduling),
                      aux_output_config=AuxOutputConfig(enable_return_routed_experts=True),
                      speculative_config=spec, device_config=installed.device_config())


def routing(prefix_hash: int) -> np.ndarray:
    """The experts a position routes to, a function of its token prefix: [LAYERS, TOP_K] int64."""
    return np.array([[_mix(prefix_hash ^ (1 + layer * TOP_K + k)) % EXPERTS for k in range(TOP_K)]
                     for layer in range(LAYERS)], dtype=np.int64)


@dataclass
class Arrival:
    step: int
    request_id: str
    prompt: list[int]
    max_tokens: int
    prompt_start: int


def make_trace(seed: int, setup: Setup) -> list[Arrival]:
    """Requests arriving over the first steps: long prompts (chunked), prompts that share prefixes
    with earlier ones (prefix hits), a prompt start past 0 for some."""
    rng = np.random.default_rng([seed, 7])
    stems = [list(rng.integers(10, 1000, int(rng.integers(6, 40)))) for _ in range(3)]
    arrivals = []
    for i in range(9):
        stem = stems[int(rng.integers(0, len(stems)))] if i >= 2 and rng.random() < 0.6 else []
        tail = list(rng.integers(10, 1000, int(rng.integers(1, 30))))
        prompt = [int(t) for t in (stem + tail)]
        start = int(rng.integers(0, len(prompt) + 1)) if rng.random() < 0.3 else 0
        arrivals.append(Arrival(step=int(i * rng.integers(1, 4)), request_id=f"r{i}", prompt=prompt,
                                max_tokens=int(rng.integers(1, 14)), prompt_start=start))
    return arrivals


class Worker:
    """The model runner, restated (see the module docstring)."""

    def __init__(self, connector, model, seed: int) -> None:
        self.connector = connector
        self.model = model
        self.seed = seed
        self.tokens: dict[str, list[int]] = {}
        self.hashes: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.features: set[str] = set()
        self.proposed: dict[str, list[int]] = {}  # drafts proposed after a request's last sampling step

    def _append(self, rid: str, token: int) -> None:
        self.tokens[rid].append(token)
        self.hashes[rid].append(content_hash(self.hashes[rid][-1] if self.hashes[rid] else 0, token))

    def execute(self, so):
        """Runs one scheduler step; returns (pending output or None, the model runner output less
        the aux output)."""
        meta = pickle.loads(pickle.dumps(so.aux_output_connector_metadata))
        self.connector.begin_step(meta)
        for new in so.scheduled_new_reqs:
            self.tokens[new.req_id], self.hashes[new.req_id] = [], []
            for token in new.prompt_token_ids:
                self._append(new.req_id, token)
            self.computed[new.req_id] = new.num_computed_tokens
            if new.num_computed_tokens:
                self.features.add("prefix_hit")
        cached = so.scheduled_cached_reqs
        for rid, num_computed in zip(cached.req_ids, cached.num_computed_tokens):
            # the scheduler's view is the device's, or ahead of it by drafts still in flight
            # (asynchronous scheduling counts them accepted until their step's output comes back)
            assert num_computed >= self.computed[rid], (rid, num_computed, self.computed[rid])
            if num_computed > self.computed[rid]:
                self.features.add("optimistic_gap")
        if so.total_num_scheduled_tokens == 0:
            return None, None
        req_ids = list(so.num_scheduled_tokens)
        rows, qsl, starts, sampled, rejected, sampled_ids = [], [0], [], [], [], []
        for rid in req_ids:
            n = so.num_scheduled_tokens[rid]
            drafts = list(so.scheduled_spec_decode_tokens.get(rid, ()))
            if drafts and drafts[0] == -1:  # placeholders: the drafts are the device's
                drafts = self.propose(rid)[:len(drafts)]
            start = self.computed[rid]
            known = n - len(drafts)
            assert start + known <= len(self.tokens[rid])
            h = self.hashes[rid][start - 1] if start else 0
            for p in range(start, start + n):
                token = self.tokens[rid][p] if p < start + known else drafts[p - start - known]
                h = self.hashes[rid][p] if p < start + known else content_hash(h, token)
                rows.append(routing(h))
            qsl.append(qsl[-1] + n)
            starts.append(start)
            rng = np.random.default_rng([self.seed, int(rid[1:]), start, n])
            if start + known == len(self.tokens[rid]):  # the last known token ran: this step samples
                accepted = int(rng.integers(0, len(drafts) + 1))
                new_token = STOP_TOKEN if rng.random() < 0.08 else int(rng.integers(10, 1000))
                out = drafts[:accepted] + [new_token]
                for token in out:
                    self._append(rid, token)
                sampled.append(len(out))
                rejected.append(len(drafts) - accepted)
                if accepted < len(drafts):
                    self.features.add("spec_rejection")
                self.computed[rid] = start + n - (len(drafts) - accepted)
                self.proposed.pop(rid, None)
            else:  # a prefill chunk short of the prompt's end
                self.features.add("chunked_prefill")
                out = []
                sampled.append(0)
                rejected.append(0)
                self.computed[rid] = start + n
            sampled_ids.append(out)
        batch = np.stack(rows)
        for layer, source in enumerate(self.model):  # vLLM's binder set each layer's capture_fn
            source.capture_fn(torch.from_numpy(np.ascontiguousarray(batch[:, layer, :])))
        pending = self.connector.prepare_output(library.InputBatch(req_ids, np.array(qsl, np.int32),
                                                                   np.array(starts, np.int32)))
        pending.enqueue_cpu_copy(num_sampled=np.array(sampled, np.int32), num_rejected=np.array(rejected, np.int32))
        output = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                   sampled_token_ids=sampled_ids)
        return pending, output

    def drafts(self, request_ids: list[str], num_spec: int) -> DraftTokenIds:
        """The drafts proposed after the last step (a drafter whose guesses are accepted at random),
        for the synchronous scheduler."""
        return DraftTokenIds(list(request_ids), [self.propose(rid)[:num_spec] for rid in request_ids])

    def propose(self, rid: str) -> list[int]:
        """The drafter's guesses past a request's known tokens (a function of their count)."""
        if rid not in self.proposed:
            rng = np.random.default_rng([self.seed, int(rid[1:]), len(self.tokens[rid]), 99])
            self.proposed[rid] = [int(t) for t in rng.integers(10, 1000, 8)]
        return self.proposed[rid]


@dataclass
class Run:
    steps: list  # per step: (aux outputs {rid: (token_start, rows)}, engine-core outputs decoded)
    routed_experts: dict  # rid -> final rows, as vLLM's output processor concatenates them
    tokens: dict  # rid -> the output tokens
    features: set  # what the trace reached


def run(model_config, setup: Setup, seed: int, impl: str) -> Run:
    config = vllm_config(model_config, setup)
    kv = installed.kv_cache_config(BLOCK, NUM_KV_BLOCKS)
    config.cache_config.num_gpu_blocks = NUM_KV_BLOCKS  # as EngineCore sets it once the KV cache is sized
    hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(BLOCK, hash_fn)
    scheduler = config.scheduler_config.get_scheduler_cls()(
        vllm_config=config, kv_cache_config=kv, structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK, hash_block_size=BLOCK, log_stats=False)
    model = installed.capture_model(LAYERS)
    if impl == "vllm":
        connector = AuxOutputWorkerConnector(vllm_config=config, model=model, kv_cache_config=kv)
    else:
        connector = library.AuxOutputWorkerConnector(vllm_config=config, model=model, kv_cache_config=kv, device="cpu")
    worker = Worker(connector, model, seed)
    encoder, decoder = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)
    arrivals = make_trace(seed, setup)
    result = Run([], {}, {}, worker.features)
    chunks: dict[str, list[np.ndarray]] = {}
    in_flight = []  # (scheduler output, pending, model runner output), oldest first
    depth = config.max_concurrent_batches

    def finish_oldest():
        so, pending, output = in_flight.pop(0)
        aux = {}
        if pending is not None:
            aux = pending.process_output()
            output.aux_output_connector_output = aux
            output = pickle.loads(pickle.dumps(output))  # worker -> engine core
        else:
            output = ModelRunnerOutput(req_ids=[], req_id_to_index={})
        engine_outputs = scheduler.update_from_output(so, output)
        decoded = {}
        for client, outs in engine_outputs.items():
            back = decoder.decode(encoder.encode(outs))  # engine core -> front end
            for o in back.outputs:
                rows = None if o.routed_experts is None else np.asarray(o.routed_experts)
                decoded[o.request_id] = (list(o.new_token_ids), None if o.finish_reason is None else str(o.finish_reason),
                                         rows)
                result.tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
                if rows is not None:
                    chunks.setdefault(o.request_id, []).append(rows)
                if o.finish_reason is not None and any(o.request_id in s.num_scheduled_tokens for s, _, _ in in_flight):
                    worker.features.add("finish_in_flight")
                if o.finish_reason is not None:
                    result.routed_experts[o.request_id] = (np.concatenate(chunks[o.request_id])
                                                           if chunks.get(o.request_id) else None)
        result.steps.append(({rid: (int(a.token_start), np.asarray(a.rows).copy()) for rid, a in aux.items()}, decoded))
        if setup.num_spec and not setup.async_scheduling:
            running = [rid for rid in (output.req_ids or ()) if rid in scheduler.requests
                       and not scheduler.requests[rid].is_finished()
                       and worker.computed[rid] >= scheduler.requests[rid].num_prompt_tokens]
            if running:
                scheduler.update_draft_token_ids(worker.drafts(running, setup.num_spec))

    step = 0
    try:
        while step < 400 and (arrivals or scheduler.has_requests() or in_flight):
            for a in [a for a in arrivals if a.step <= step]:
                arrivals.remove(a)
                params = SamplingParams(max_tokens=a.max_tokens, stop_token_ids=[STOP_TOKEN],
                                        routed_experts_prompt_start=a.prompt_start)
                scheduler.add_request(Request(a.request_id, a.prompt, params, None, block_hasher=hasher))
            # EngineCore.step_with_batch_queue: schedule while the queue has room, else (or when
            # nothing was scheduled) process the oldest step in flight
            scheduled = scheduler.has_requests() and len(in_flight) < depth
            if scheduled:
                so = scheduler.schedule()
                pending, output = worker.execute(so)
                in_flight.append((so, pending, output))
            if in_flight and (not scheduled or len(in_flight) >= depth):
                finish_oldest()
            step += 1
        while in_flight:
            finish_oldest()
    finally:
        connector.close()
    assert not scheduler.has_requests(), f"{setup.name} seed {seed}: requests left after {step} steps"
    return result


def truth(model_config, setup, seed, result: Run) -> dict:
    """What every request's routed_experts must be: the routing of positions [prompt start,
    prompt + outputs - 1), from the tokens the request ended with."""
    expected = {}
    for a in make_trace(seed, setup):
        tokens = a.prompt + result.tokens.get(a.request_id, [])
        h, rows = 0, []
        for token in tokens[:-1]:
            h = content_hash(h, token)
            rows.append(routing(h))
        start = min(a.prompt_start, len(a.prompt))
        expected[a.request_id] = np.stack(rows[start:]).astype(np.uint8) if rows[start:] else None
    return expected


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None or (a is not None and len(a) == 0) or (b is not None and len(b) == 0)
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("setup", SETUPS, ids=lambda s: s.name)
def test_vllm_scheduler_with_both_connectors(model_config, setup, seed):
    theirs = run(model_config, setup, seed, "vllm")
    ours = run(model_config, setup, seed, "routing_replay")
    problems = []
    if len(theirs.steps) != len(ours.steps):
        problems.append(f"{len(theirs.steps)} steps with vLLM's connector, {len(ours.steps)} with ours")
    for i, ((aux_a, eng_a), (aux_b, eng_b)) in enumerate(zip(theirs.steps, ours.steps)):
        if aux_a.keys() != aux_b.keys():
            problems.append(f"step {i}: vLLM's connector emitted for {sorted(aux_a)}, ours for {sorted(aux_b)}")
        for rid in aux_a.keys() & aux_b.keys():
            (ta, ra), (tb, rb) = aux_a[rid], aux_b[rid]
            if ta != tb or not _same(ra, rb):
                problems.append(f"step {i} request {rid}: vLLM's connector token_start {ta} rows {ra.shape} "
                                f"{ra.dtype}, ours {tb} {rb.shape} {rb.dtype} (rows or start differ)")
        if eng_a.keys() != eng_b.keys():
            problems.append(f"step {i}: engine outputs for {sorted(eng_a)} and {sorted(eng_b)}")
        for rid in eng_a.keys() & eng_b.keys():
            (tok_a, fin_a, rows_a), (tok_b, fin_b, rows_b) = eng_a[rid], eng_b[rid]
            if tok_a != tok_b or fin_a != fin_b or not _same(rows_a, rows_b):
                problems.append(f"step {i} request {rid}: engine output (tokens, finish reason, routed_experts) "
                                f"differs: ({tok_a}, {fin_a}) vs ({tok_b}, {fin_b})")
    want = truth(model_config, setup, seed, theirs)
    for rid, expected in want.items():
        for name, result in (("vLLM's connector", theirs), ("ours", ours)):
            got = result.routed_experts.get(rid, "unfinished")
            if isinstance(got, str) or not _same(expected, got):
                problems.append(f"request {rid}: final routed_experts with {name} differ: "
                                f"{got if isinstance(got, str) else None if got is None else got.shape}, "
                                f"expected {None if expected is None else expected.shape}")
    assert not problems, f"{setup.name} seed {seed}: {len(problems)} differences:\n" + "\n".join(problems[:30])


def test_the_traces_reach_every_scenario(model_config):
    """Across the setups and seeds: chunked prefill, prefix hits, a prompt start past 0, rejected
    drafts, a step scheduled past rejected drafts still in flight (the scheduler ahead of the device),
    a request that stopped with a step of it in flight."""
    seen = set()
    for setup in SETUPS:
        for seed in SEEDS:
            seen |= run(model_config, setup, seed, "routing_replay").features
            if any(a.prompt_start > 0 for a in make_trace(seed, setup)):
                seen.add("prompt_start")
    assert {"chunked_prefill", "prompt_start", "prefix_hit", "spec_rejection", "finish_in_flight",
            "optimistic_gap"} <= seen, seen
