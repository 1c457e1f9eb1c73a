"""vLLM 0.33's routed-experts worker connector and routing_replay.vllm, side by side, in one process.

One synthetic engine (48 MoE layers, top-8 of 128 experts, KV hash blocks of 16 tokens,
max_num_batched_tokens 8192; the router's ids a pure function of request, position, layer and k)
drives each implementation through the same engine-side calls, eager, as vLLM's model runner does:

  begin_step(metadata)                    the scheduler's emit starts and new block hashes
  capture(layer, topk_ids) x 48           the forward (not timed)
  prepare_output(input_batch)             the step's snapshot
  enqueue_cpu_copy(num_sampled=, num_rejected=)   on a side copy stream (CUDA), an event after it
  wait for the copy; process_output()     each request's new rows (AuxRequestOutput)

The device is drained before the timed calls (CUDA: synchronize; host backend: 1 ms for its worker
threads), so the figures are the engine's host path per step: begin_step + prepare_output +
enqueue_cpu_copy + the wait + process_output. Every request's emitted rows are checked against the
ids its forward produced (on arrival, outside the timed calls). Then, by --outputs:

  dropped   each step's outputs let go, as a multi-process engine does once it has sent them (an
            implementation whose outputs are views of its host memory may reuse it at once)
  kept      each step's rows appended to the request's chunks and concatenated when the request
            finishes, as vLLM 0.33's in-process output processor does (the LLM class with
            VLLM_ENABLE_V1_MULTIPROCESSING=0, as colocated RL frameworks run it): the memory of
            every output stays with the consumer until then

Both modes run by default, each scenario dropped first, then kept, on both implementations.

Scenarios:
  decode_B1/B64/B256/B1024  B requests decoding one token per step, prompts prefilled first (untimed),
                            rows emitted from the end of the prompt
  decode_silent_B64/B1024   the same steps with nothing emitted (every emit start past the end): the
                            path without the per-request output objects (not in the default set);
                            the slope's difference from decode's is what those objects cost
  prefill_8k                4 new requests of 2048 tokens each step (all their rows emitted), each
                            finished in the next step's metadata
  multi_turn                64 conversations x 20 turns: each turn a new request whose prompt is the
                            whole conversation so far (a prefix hit on the previous turn's blocks, which
                            the store holds), emitting from the new turn; 1 prefill + 7 decode steps a
                            turn; timed from the second turn on
  store_probe               requests filing 512 blocks (8192 tokens) each, nothing emitted: the host
                            memory (RSS) the store takes per filed block, once warm

One JSON line per (implementation, scenario, outputs, backend): host_us_median/p90; connector_us_median (the
connector's calls alone: begin_step, prepare_output, enqueue_cpu_copy, the wait, process_output,
without the engine's copy-stream and event work; the targets' definition) (and begin_us, prepare_us:
prepare_output + enqueue_cpu_copy, process_us: the wait + process_output; calls_us_median: each call
alone, and the engine's own copy-stream and event work around enqueue_cpu_copy), per_request_ns, minflt_per_step
(minor page faults of the engine's thread in the timed calls, median over steady-state steps; _mean:
their mean; minflt_process_per_step_mean: the whole process's in the same window, background threads
included, which may also fault outside it), correct, rows_checked; then one
line per implementation and outputs mode with the per-request slope between decode_B64 and
decode_B1024, and one line per scenario and mode with the ratios vLLM / routing_replay (host path,
connector calls alone). routing_replay's lines carry kept_pool: its pool of output memory at the end
of the scenario (connector.kept_pool: bytes held, in use, their high-water mark, the budget, and the
growth the filling thread made and any the engine's thread had to make). With
--gpu-time (CUDA), each line also has compute_stream_us_median: the compute stream's time for
prepare_output's work (vLLM: the snapshot's clone; the library: the end-of-step kernel), timed with
CUDA events behind a spin kernel; that run's host figures include waiting for the spin kernel.

Usage:
  python3 benchmarks/python/vllm_side_by_side.py [--device cuda|cpu] [--peers PATH] [--steps N]
      [--scenarios decode_B1,...] [--impls vllm,routing_replay,routing_replay_copy] [--prompt P]
      [--outputs dropped,kept]
      [--gpu-time]
The peer (vLLM 0.33's code with its imports stubbed) is loaded from --peers, else from
$ROUTING_REPLAY_PEERS, <checkout>/.peers or <checkout>/../shared/peers; it needs torch (CPU torch
runs it on the host).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np

L, K, E, BLOCK, NMAX = 48, 8, 128, 16, 8192
CHECKOUT = Path(__file__).resolve().parents[2]
ALL_SCENARIOS = ["decode_B1", "decode_B64", "decode_B256", "decode_B1024", "prefill_8k", "multi_turn", "store_probe"]
ARGS = argparse.Namespace()


def expected_rows(content: int, start: int, end: int) -> np.ndarray:
    pos = np.arange(start, end, dtype=np.int64)[:, None, None]
    return (content * 7919 + pos * 31 + np.arange(L)[None, :, None] * 131 + np.arange(K)[None, None, :] * 17) % E


def block_hash(content: int, index: int) -> bytes:
    return hashlib.blake2b(f"{content}:{index}".encode(), digest_size=32).digest()


def faults_now() -> tuple[int, int]:
    """Minor page faults so far: of this (the engine's) thread, and of the whole process (its
    background threads too: vLLM's store writer, the library's filing thread)."""
    return (resource.getrusage(resource.RUSAGE_THREAD).ru_minflt,
            resource.getrusage(resource.RUSAGE_SELF).ru_minflt)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def find_peer(path: str | None) -> Path:
    folders = [Path(path)] if path else []
    if os.environ.get("ROUTING_REPLAY_PEERS"):
        folders.append(Path(os.environ["ROUTING_REPLAY_PEERS"]))
    folders += [CHECKOUT / ".peers", CHECKOUT.parent / "shared" / "peers"]
    for folder in folders:
        if (folder / "vllm_0_33_routed_experts.py").is_file():
            return folder / "vllm_0_33_routed_experts.py"
    raise SystemExit(f"vllm_0_33_routed_experts.py not found in {', '.join(map(str, folders))}")


# -- requests and the scheduler's metadata ---------------------------------------------------------
class Request:
    """A request over content `content`: positions [0, prompt) are its prompt, rows emitted from
    `emit`; `computed` positions are computed (prefix hit included), `known` tokens known."""

    def __init__(self, rid: str, content: int, prompt: int, emit: int, computed: int = 0) -> None:
        self.rid, self.content, self.prompt, self.emit = rid, content, prompt, emit
        self.computed, self.known, self.sent = computed, prompt, 0
        self.outputs: list = []
        self.chunks: list = []  # kept outputs' rows until the finish
        self.kept_rows = 0

    def new_hashes(self, upto: int) -> list[bytes]:
        keyed = min(self.known, upto) // BLOCK
        hashes = [block_hash(self.content, i) for i in range(self.sent, keyed)]
        self.sent = max(self.sent, keyed)
        return hashes


class Step:
    """One step: (request, tokens) in batch order, and requests finished since the last step."""

    def __init__(self, scheduled, finished=(), timed=True) -> None:
        self.scheduled, self.finished, self.timed = scheduled, list(finished), timed


def decode_steps(batch: int, prompt: int, steps: int, emit: bool = True):
    never = 1 << 40  # an emit start no request reaches: nothing is emitted
    reqs = [Request(f"d{r}", r, prompt, prompt if emit else never) for r in range(batch)]
    per_step = max(1, NMAX // prompt)
    for g in range(0, batch, per_step):
        yield Step([(r, prompt) for r in reqs[g:g + per_step]], timed=False)
    for s in range(steps + 2):
        yield Step([(r, 1) for r in reqs], timed=s >= 2)
    yield Step([], finished=reqs, timed=False)


def prefill_steps(steps: int):
    previous = []
    for s in range(steps + 1):
        reqs = [Request(f"p{s}-{j}", 100_000 + 4 * s + j, NMAX // 4, 0) for j in range(4)]
        yield Step([(r, NMAX // 4) for r in reqs], finished=previous, timed=s >= 1)
        previous = reqs
    yield Step([], finished=previous, timed=False)


def multi_turn_steps(conversations: int = 64, turns: int = 20, user: int = 32, generated: int = 8):
    length = {c: 0 for c in range(conversations)}  # tokens of each conversation so far
    computed = {c: 0 for c in range(conversations)}  # positions whose rows some turn computed
    previous = []
    for t in range(turns):
        reqs = []
        for c in range(conversations):
            prompt = length[c] + user
            hit = min(computed[c], prompt - 1) // BLOCK * BLOCK
            reqs.append(Request(f"c{c}-t{t}", 200_000 + c, prompt, length[c], computed=hit))
        yield Step([(r, r.prompt - r.computed) for r in reqs], finished=previous, timed=t >= 1)
        for _ in range(generated - 1):
            yield Step([(r, 1) for r in reqs], timed=t >= 1)
        for r, c in zip(reqs, range(conversations)):
            length[c] = r.prompt + generated
            computed[c] = r.prompt + generated - 1
        previous = reqs
    yield Step([], finished=previous, timed=False)


def probe_steps():
    """Two requests filing 512 blocks each, nothing emitted; the second is measured (the first has
    the process's transient buffers allocated, so only the store's own memory grows)."""
    first, second = Request("probe-0", 300_000, NMAX, NMAX + 1), Request("probe-1", 300_001, NMAX, NMAX + 1)
    yield Step([(first, NMAX)], timed=False)
    yield Step([(second, NMAX)], finished=[first], timed=True)
    yield Step([], finished=[second], timed=False)


# -- implementations --------------------------------------------------------------------------------
class Impl:
    def __init__(self, name, module, backend):
        self.name, self.module, self.backend = name, module, backend
        self.cuda = backend == "cuda"
        if self.cuda:
            import torch

            self.torch = torch
            self.copy_stream = torch.cuda.Stream()

    def make(self, max_num_seqs: int, num_kv_blocks: int):
        kwargs = dict(block_size=BLOCK, num_kv_blocks=num_kv_blocks, max_concurrent_batches=2)
        if self.name.startswith("routing_replay"):
            kwargs["device"] = "cuda" if self.cuda else "cpu"
        conn = self.module.make_worker_connector(L, E, K, NMAX, max_num_seqs, **kwargs)
        if self.name == "routing_replay_copy":  # every step through the device snapshot and a copy
            conn.native.direct_write_bytes = 0
        self.capturer = getattr(conn, "_capturer", None) or conn.capturer
        return conn

    def metadata(self, meta: dict):
        pack = self.module.PackedBlockHashes
        hashes = {rid: pack(b"".join(h), 32) for rid, h in meta["hashes"].items()}
        return self.module.AuxOutputConnectorMetadata(0, meta["requests"], hashes, tuple(meta["finished"]))

    def drain(self, conn) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()
        else:
            sync = getattr(conn, "synchronize", None)
            if sync is not None:
                sync()
            time.sleep(0.001)  # the host backend's worker threads finish, as a GPU would be idle

    def enqueue(self, pending, num_sampled, num_rejected, clock):
        """The engine's copy of one step: on a side copy stream with an event after it (CUDA), as
        vLLM's output thread does. Returns (event or None, ns inside enqueue_cpu_copy alone)."""
        if not self.cuda:
            t = clock()
            pending.enqueue_cpu_copy(num_sampled=num_sampled, num_rejected=num_rejected)
            return None, clock() - t
        torch = self.torch
        self.copy_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.copy_stream):
            t = clock()
            pending.enqueue_cpu_copy(num_sampled=num_sampled, num_rejected=num_rejected)
            inside = clock() - t
            event = torch.cuda.Event(blocking=True)
            event.record(self.copy_stream)
        return event, inside


class Forward:
    """The router outputs of one step, per layer int64 [n, K]: numpy (host backend, and the peer on
    the CPU) or torch on the implementation's device."""

    def __init__(self, impl: Impl, peer_device=None):
        self.impl = impl
        self.kk = np.arange(K, dtype=np.int64) * 17
        self.torch_device = peer_device if impl.name == "vllm" else ("cuda" if impl.cuda else None)
        if self.torch_device is not None:
            import torch

            self.torch = torch
            self.kk_t = torch.arange(K, dtype=torch.int64, device=self.torch_device) * 17

    def run(self, step: Step) -> None:
        content = np.concatenate([np.full(n, r.content, np.int64) for r, n in step.scheduled])
        pos = np.concatenate([np.arange(r.computed, r.computed + n, dtype=np.int64) for r, n in step.scheduled])
        base = content * 7919 + pos * 31
        capture = self.impl.capturer.capture
        if self.torch_device is None:
            for layer in range(L):
                capture(layer, (base[:, None] + layer * 131 + self.kk[None, :]) % E)
        else:
            t = self.torch.from_numpy(base).to(self.torch_device)
            for layer in range(L):
                capture(layer, (t[:, None] + layer * 131 + self.kk_t[None, :]) % E)


def finish_kept(finished) -> None:
    """Kept outputs: a finished request's chunks concatenated into its final rows and the chunks let
    go, as vLLM's output processor does at the finish (the final array goes to the user: dropped
    here), outside the timed calls."""
    for r in finished:
        if r.chunks:
            final = np.concatenate(r.chunks)
            r.kept_rows += len(final)
            r.chunks.clear()
            del final


def run_scenario(impl: Impl, name: str, steps, max_num_seqs: int, num_kv_blocks: int, peer_device,
                 outputs: str = "dropped") -> dict:
    keep = outputs == "kept"
    rss0 = rss_bytes()
    conn = impl.make(max_num_seqs, num_kv_blocks)
    rss1 = rss_bytes()
    forward = Forward(impl, peer_device)
    times = {"host": [], "connector": [], "begin": [], "prepare": [], "process": [], "prepare_output": [], "enqueue_cpu_copy": [],
             "engine_copy_work": [], "wait": [], "process_output": [], "compute_stream": []}
    faults, process_faults, requests_per_step, everyone = [], [], [], {}
    rss_filed = None
    for step in steps:
        meta = {"requests": {}, "hashes": {}, "finished": [r.rid for r in step.finished]}
        for r, n in step.scheduled:
            everyone[r.rid] = r
            meta["requests"][r.rid] = r.emit
            new = r.new_hashes(r.computed + n)
            if new:
                meta["hashes"][r.rid] = new
        for r in step.finished:
            new = r.new_hashes(r.computed)
            if new:
                meta["hashes"][r.rid] = new
        metadata = impl.metadata(meta)
        if keep:
            finish_kept(step.finished)
        impl.drain(conn)
        f0, p0 = faults_now()
        t0 = time.perf_counter_ns()
        conn.begin_step(metadata)
        t1 = time.perf_counter_ns()
        f1, p1 = faults_now()
        if not step.scheduled:
            continue
        forward.run(step)
        n = len(step.scheduled)
        counts = [c for _, c in step.scheduled]
        batch = SimpleNamespace(req_ids=[r.rid for r, _ in step.scheduled],
                                query_start_loc_np=np.concatenate([[0], np.cumsum(counts)]).astype(np.int32),
                                num_computed_tokens_np=np.array([r.computed for r, _ in step.scheduled], np.int32))
        sampled = np.array([1 if r.computed + c >= r.prompt else 0 for r, c in step.scheduled], np.int32)
        rejected = np.zeros(n, np.int32)
        impl.drain(conn)
        rss_before = rss_bytes()
        gpu_clock = impl.cuda and ARGS.gpu_time
        if gpu_clock:  # the compute stream's time for prepare_output's work (outside the host timers):
            # a spin kernel first keeps the stream busy until that work is queued, so the two events
            # bracket the work alone, not the host's time to launch it
            g0, g1 = (impl.torch.cuda.Event(enable_timing=True) for _ in range(2))
            impl.torch.cuda._sleep(1_000_000)
            g0.record()
        f2, p2 = faults_now()
        t2 = time.perf_counter_ns()
        pending = conn.prepare_output(batch)
        t2a = time.perf_counter_ns()
        if gpu_clock:
            g1.record()
        event, enqueue_ns = impl.enqueue(pending, sampled, rejected, time.perf_counter_ns)
        t3 = time.perf_counter_ns()
        if event is not None:
            event.synchronize()
        t3a = time.perf_counter_ns()
        out = pending.process_output()
        t4 = time.perf_counter_ns()
        if gpu_clock and step.timed:
            g1.synchronize()
            times["compute_stream"].append(g0.elapsed_time(g1) * 1e3)
        f3, p3 = faults_now()
        if name == "store_probe" and step.timed:
            time.sleep(0.2)  # writer threads (vLLM's store writes in the background) finish
            rss_filed = rss_bytes() - rss_before
        for rid, o in out.items():  # checked now; dropped, or kept until the request finishes
            r = everyone[rid]
            start, rows = int(o.token_start), o.rows
            exact = isinstance(rows, np.ndarray) and np.array_equal(rows, expected_rows(r.content, start, start + len(rows)))
            r.outputs.append((start, len(rows), exact))
            if keep:  # vLLM's output processor: each step's rows appended to the request's chunks
                r.chunks.append(rows)
        del out
        for r, c in step.scheduled:
            r.computed += c
            r.known = max(r.known, r.computed + (1 if r.computed >= r.prompt else 0))
        if step.timed:
            times["begin"].append((t1 - t0) / 1e3)
            times["prepare"].append((t3 - t2) / 1e3)
            times["process"].append((t4 - t3) / 1e3)
            # each call alone; "engine" is the engine's own copy-stream and event work around the copy
            times["prepare_output"].append((t2a - t2) / 1e3)
            times["enqueue_cpu_copy"].append(enqueue_ns / 1e3)
            times["engine_copy_work"].append((t3 - t2a - enqueue_ns) / 1e3)
            times["wait"].append((t3a - t3) / 1e3)
            times["process_output"].append((t4 - t3a) / 1e3)
            times["host"].append((t1 - t0 + t4 - t2) / 1e3)
            # the connector's calls alone, as vLLM's worker makes them (the engine's copy-stream and
            # event work, the same whichever connector, left out)
            times["connector"].append((t1 - t0 + t2a - t2 + enqueue_ns + t4 - t3) / 1e3)
            faults.append(f1 - f0 + f3 - f2)
            process_faults.append(p1 - p0 + p3 - p2)
            requests_per_step.append(n)
    pool = kept_pool_stats(conn)
    if keep:
        finish_kept(everyone.values())
    conn.close()
    correct, rows_checked = check(everyone.values())
    host = times["host"]
    result = {
        "impl": impl.name, "scenario": name, "backend": impl.backend, "outputs": outputs, "steps": len(host),
        "requests_per_step": statistics.median(requests_per_step) if requests_per_step else 0,
        "host_us_median": med(host), "host_us_p90": p90(host), "connector_us_median": med(times["connector"]),
        "begin_us_median": med(times["begin"]), "prepare_us_median": med(times["prepare"]),
        "process_us_median": med(times["process"]),
        "calls_us_median": {k: med(times[k]) for k in ("prepare_output", "enqueue_cpu_copy", "engine_copy_work", "wait",
                                                       "process_output")},
        "per_request_ns": round(1e3 * med(host) / statistics.median(requests_per_step), 1) if host else None,
        "minflt_per_step": statistics.median(faults) if faults else None,
        "minflt_per_step_mean": round(statistics.fmean(faults), 2) if faults else None,
        "minflt_process_per_step_mean": round(statistics.fmean(process_faults), 2) if process_faults else None,
        "correct": correct, "rows_checked": rows_checked,
        "block_bytes": BLOCK * L * K, "rss_construct_bytes": rss1 - rss0,
    }
    if pool is not None:
        result["kept_pool"] = pool
    if times["compute_stream"]:
        result["compute_stream_us_median"] = med(times["compute_stream"])
    if name == "store_probe":
        result["rss_per_filed_block_bytes"] = round(rss_filed / (NMAX // BLOCK), 1)
    return result


def kept_pool_stats(conn):
    """The library's pool of output memory (size, high-water mark, growth off and on the engine's
    thread) where the connector has one."""
    stats = getattr(conn, "kept_pool", None)
    return dict(stats) if stats is not None else None


def check(requests) -> tuple[bool, int]:
    """Each request's outputs: contiguous from its emit start, each equal to its forward's ids."""
    rows_checked = 0
    for r in requests:
        cursor = r.emit
        for token_start, count, exact in r.outputs:
            if token_start != cursor or not exact:
                return False, rows_checked
            cursor += count
            rows_checked += count
        if r.emit <= r.computed and cursor != r.computed:  # every computed row from the emit start
            return False, rows_checked
    return True, rows_checked


def med(xs):
    return round(statistics.median(xs), 2) if xs else None


def p90(xs):
    return round(float(np.percentile(xs, 90)), 2) if xs else None


def scenario_steps(name: str, cuda: bool):
    prompt = ARGS.prompt or (1024 if cuda else 32)
    if name.startswith(("decode_B", "decode_silent_B")):
        batch = int(name.rpartition("_B")[2])
        return (decode_steps(batch, prompt, ARGS.steps, emit=not name.startswith("decode_silent")), batch,
                batch * (prompt + ARGS.steps + 8) // BLOCK + 64)
    if name == "prefill_8k":
        steps = ARGS.prefill_steps
        return prefill_steps(steps), 8, (steps + 2) * NMAX // BLOCK + 64
    if name == "multi_turn":
        return multi_turn_steps(turns=ARGS.turns), 128, 64 * ARGS.turns * 40 // BLOCK + 1024
    if name == "store_probe":
        return probe_steps(), 4, NMAX // BLOCK * 4
    raise SystemExit(f"unknown scenario {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None)
    parser.add_argument("--peers", default=None, help="folder holding vllm_0_33_routed_experts.py")
    parser.add_argument("--steps", type=int, default=None, help="timed decode steps (default 64 on CUDA, 16 on CPU)")
    parser.add_argument("--prefill-steps", type=int, default=None)
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--prompt", type=int, default=None, help="decode scenarios' prompt (1024 CUDA, 32 CPU)")
    parser.add_argument("--scenarios", default=",".join(ALL_SCENARIOS))
    parser.add_argument("--outputs", default="dropped,kept",
                        help="dropped: each step's outputs checked and let go (a multi-process engine, once sent); "
                             "kept: held until the request finishes, then concatenated (vLLM's in-process output "
                             "processor)")
    parser.add_argument("--impls", default="vllm,routing_replay",
                        help="any of vllm, routing_replay, routing_replay_copy (the library with every step "
                             "through the device snapshot and a copy on the output stream)")
    parser.add_argument("--gpu-time", action="store_true",
                        help="CUDA: also time prepare_output's work on the compute stream with CUDA events "
                             "behind a spin kernel (compute_stream_us_median); the wait then includes that "
                             "kernel, so take the host figures from a run without this flag")
    parser.parse_args(namespace=ARGS)
    try:
        import torch
    except ImportError:
        torch = None
    cuda = ARGS.device == "cuda" or (ARGS.device is None and torch is not None and torch.cuda.is_available())
    ARGS.steps = ARGS.steps or (64 if cuda else 16)
    ARGS.prefill_steps = ARGS.prefill_steps or (32 if cuda else 6)
    backend = "cuda" if cuda else "cpu"
    if torch is not None and not cuda:
        torch.set_num_threads(1)  # the peer's small CPU ops; idle torch threads would spin on the cores
    machine = {"machine": os.uname().nodename, "cpus": os.cpu_count(), "backend": backend,
               "date": time.strftime("%Y-%m-%d"), "torch": getattr(torch, "__version__", None)}
    if cuda:
        machine["device"] = torch.cuda.get_device_name()
    print(json.dumps({"machine": machine}), flush=True)
    impls = []
    for name in ARGS.impls.split(","):
        if name == "vllm":
            if torch is None:
                print(json.dumps({"impl": "vllm", "error": "torch is not installed (the peer needs it)"}), flush=True)
                continue
            path = find_peer(ARGS.peers)
            spec = importlib.util.spec_from_file_location("vllm_0_33_peer", path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module  # its dataclasses look their module up
            spec.loader.exec_module(module)
            module.current_platform.device_type = "cuda" if cuda else "cpu"
            module.logger.setLevel("ERROR")
            impls.append(Impl("vllm", module, backend))
        elif name in ("routing_replay", "routing_replay_copy"):
            try:
                import routing_replay.vllm as module
                module.make_worker_connector
            except (ImportError, AttributeError) as error:
                print(json.dumps({"impl": "routing_replay", "error": f"routing_replay.vllm: {error}"}), flush=True)
                continue
            impls.append(Impl(name, module, backend))
    peer_device = "cuda" if cuda else "cpu"
    results = {}
    modes = ARGS.outputs.split(",")
    for name in ARGS.scenarios.split(","):
        for mode in modes:
            for impl in impls:
                steps, seqs, blocks = scenario_steps(name, cuda)
                result = run_scenario(impl, name, steps, seqs, blocks, peer_device, mode)
                results[(impl.name, name, mode)] = result
                print(json.dumps(result), flush=True)
    for mode in modes:
        for impl in impls:
            for kind in ("decode", "decode_silent"):
                a, b = results.get((impl.name, f"{kind}_B64", mode)), results.get((impl.name, f"{kind}_B1024", mode))
                if a and b:
                    slope = (b["host_us_median"] - a["host_us_median"]) / (1024 - 64)
                    key = "slope_us_per_request_B64_B1024" + ("_silent" if kind == "decode_silent" else "")
                    print(json.dumps({"impl": impl.name, "backend": backend, "outputs": mode, key: round(slope, 4)}),
                          flush=True)
        for name in ARGS.scenarios.split(","):
            a, b = results.get(("vllm", name, mode)), results.get(("routing_replay", name, mode))
            if a and b and a["host_us_median"] and b["host_us_median"]:
                print(json.dumps({"scenario": name, "backend": backend, "outputs": mode,
                                  "ratio_vllm_over_routing_replay": round(a["host_us_median"] / b["host_us_median"], 2),
                                  "connector_ratio_vllm_over_routing_replay":
                                      round(a["connector_us_median"] / b["connector_us_median"], 2)}),
                      flush=True)


if __name__ == "__main__":
    main()
