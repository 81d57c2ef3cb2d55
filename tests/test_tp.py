"""Tensor parallelism on CPU (gloo): the split and its errors, the collectives, the step mirror, the
mixture-of-experts models' shards (every rank holds every expert's slice, one all-reduce per MoE layer), and
whole engines at tp=2 and tp=4 against tp=1, token for token (float32, greedy), through LLM.generate,
``nanostream serve --tensor-parallel-size 2`` and a two-"host" torchrun-style launch; a worker killed
(SIGKILL) or stopped (SIGSTOP) is the engine's death, seen by every stream, and leaves no process behind.

The fast tests run the ranks as threads of this process (gloo groups on a store of their own); the
``slow`` ones start real worker processes.
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import anyio
import pytest
import torch
import torch.distributed as dist
from helpers import engine_processes, run_in_thread
from transformers import AutoConfig

from nanostream import LLM, AsyncClient, EngineDeadError, SamplingParams
from nanostream.client.launch import READY
from nanostream.distributed import SINGLE, TensorParallel
from nanostream.distributed.group import FRAME_BYTES
from nanostream.distributed.liveness import beat_key
from nanostream.distributed.rendezvous import MULTICAST_OFF, Rendezvous, host_locally
from nanostream.engine.block_manager import BlockManager
from nanostream.engine.runner.kv_pool import WarmupChunk, allocate_kv_pool
from nanostream.engine.runner.sampler import SamplerOutput
from nanostream.engine.runner.step_inputs import pack_step
from nanostream.engine.scheduler import Scheduler
from nanostream.engine.sequence import Sequence
from nanostream.engine.tp.control import StepReader, StepWriter, decode, encode
from nanostream.engine.tp.workers import PARENT_VARIABLE, worker_environment
from nanostream.layers.attention import ForwardContext
from nanostream.layers.attention_backend import TorchAttention
from nanostream.layers.layer_kernels import LayerKernels
from nanostream.layers.moe_spec import MoESpec
from nanostream.models import decoder_spec, load_model
from nanostream.models.sharding import check_split, shard_decoder
from nanostream.testing import TINY_PRESETS, make_tiny_model

CPU = torch.device("cpu")
# Few KV blocks (preemption), a small step budget (chunked prefill), prompts sharing a prefix (cache hits).
ENGINE = dict(device="cpu", dtype="float32", max_model_len=256, kvcache_block_size=8, num_kvcache_blocks=24,
              max_num_seqs=6, max_num_batched_tokens=32)  # fmt: skip
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def workload() -> list[list[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(3, 500) for _ in range(40)]
    prompts = [shared + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 20))] for _ in range(6)]
    return [*prompts, [rng.randrange(3, 500) for _ in range(70)]]  # 70 tokens: three chunks of 32


def spec_of(path: Path, **changes):
    spec = decoder_spec(AutoConfig.from_pretrained(path), max_model_len=256)
    return dataclasses.replace(spec, **changes)


def children(pid: int) -> list[int]:
    """The live child processes of ``pid`` (Linux)."""
    listed = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return [c for c in listed if alive(c)]


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


# ---- the split -------------------------------------------------------------------------------------


def test_kv_heads_are_replicated_on_the_ranks_whose_query_heads_read_them(qwen3_dir):
    spec = spec_of(qwen3_dir)  # 4 query heads, 2 KV heads
    assert (spec.num_heads, spec.num_kv_heads) == (4, 2)
    shards = [shard_decoder(spec, r, 4) for r in range(4)]
    assert [list(s.heads) for s in shards] == [[0], [1], [2], [3]]
    assert [list(s.kv_heads) for s in shards] == [[0], [0], [1], [1]]  # query head h reads KV head h // 2
    two = [shard_decoder(spec, r, 2) for r in range(2)]
    assert [(list(s.heads), list(s.kv_heads), s.vocab) for s in two] == [
        ([0, 1], [0], range(0, spec.vocab_size // 2)),
        ([2, 3], [1], range(spec.vocab_size // 2, spec.vocab_size)),
    ]


@pytest.mark.parametrize(
    ("changes", "size", "message"),
    [
        ({}, 3, r"num_attention_heads \(4\) is not divisible by it"),
        ({"num_heads": 6, "num_kv_heads": 3}, 2, r"num_key_value_heads \(3\) is not divisible by it"),
        ({"num_heads": 12, "num_kv_heads": 4}, 6, r"it is not a multiple of num_key_value_heads \(4\)"),
        ({"intermediate_size": 130}, 4, r"intermediate_size \(130\) is not divisible by it"),
        ({"vocab_size": 515}, 2, r"vocab_size \(515\) is not divisible by it"),
        ({"moe": MoESpec(8, 2, 33, True, False, (0, 1))}, 2, r"the experts' intermediate size \(33\) is not divisible"),
        ({"moe": MoESpec(8, 2, 32, True, False, (1,), 50)}, 4, r"shared_expert_intermediate_size \(50\) is not"),
    ],
)
def test_a_split_that_cannot_be_made_names_the_numbers(qwen3_dir, changes, size, message):
    with pytest.raises(ValueError, match=f"tensor_parallel_size={size} cannot split Qwen3ForCausalLM: .*{message}"):
        check_split(spec_of(qwen3_dir, **changes), size)


def test_the_engine_refuses_an_impossible_split_before_starting_any_process(tmp_path):
    path = make_tiny_model(tmp_path, vocab_size=515)  # the tokenizer's 512 ids, and 3 more rows
    before = set(children(os.getpid()))
    with pytest.raises(ValueError, match=r"vocab_size \(515\) is not divisible by it.*divides the model: 1$"):
        LLM(str(path), tensor_parallel_size=2, **ENGINE)
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\).*tensor_parallel_size that divides the model"):
        LLM(str(path), tensor_parallel_size=3, **ENGINE)
    assert set(children(os.getpid())) == before


# ---- ranks as threads ------------------------------------------------------------------------------


def in_threads(size: int, fn):
    """``fn(tp)`` on ``size`` ranks, each a thread of this process with gloo groups; the results by rank."""
    rendezvous, store = host_locally(size)
    results, errors = {}, []

    def rank(r: int) -> None:
        try:
            own = store if r == 0 else rendezvous.for_rank(r).connect()
            results[r] = fn(TensorParallel.connect(own, r, size, r, CPU))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return results


def test_a_worker_started_here_takes_this_process_environment_and_its_rank(monkeypatch):
    # NCCL reads its settings from each rank's environment and the ranks must agree: a worker gets rank 0's
    # (whatever its entry point chose, multicast on or off), never values the library made up.
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    monkeypatch.delenv("NVSHMEM_DISABLE_NVLS", raising=False)
    before = dict(os.environ)
    env = worker_environment(Rendezvous("127.0.0.1", 29500, 3, 0).for_rank(2), os.environ)
    assert dict(os.environ) == before  # nothing written here
    assert env["NCCL_NVLS_ENABLE"] == "1" and "NVSHMEM_DISABLE_NVLS" not in env
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["MASTER_PORT"]) == ("2", "2", "3", "29500")
    assert env[PARENT_VARIABLE] == str(os.getpid())
    assert set(MULTICAST_OFF) <= set(worker_environment(Rendezvous("h", 1, 2, 0), MULTICAST_OFF))


BEATING_CHILD = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
import nanostream.distributed.liveness as liveness
liveness.BEAT_INTERVAL = 0.0  # always inside the store's client: exiting under a live beat would abort
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=timedelta(seconds=10))
lost = []
beat = liveness.Heartbeat(store, 1, lost.append, None).start()
time.sleep(0.2)
assert beat.stop() and not lost, lost
"""


def test_a_worker_heartbeat_stops_before_the_process_exits():
    # A worker told to stop returns from its main thread; a beat still inside the store's client as the
    # interpreter finalizes kills the process with SIGABRT (exit -6). With beats back to back, every exit
    # falls inside one unless the beat was stopped first.
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    for _ in range(3):
        done = subprocess.run([sys.executable, "-c", BEATING_CHILD, str(server.port)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
    assert server.add(beat_key(1), 0) > 0  # the children did beat


def test_collectives_and_the_control_channel():
    long = bytes(range(256)) * (FRAME_BYTES // 128)  # two frames' worth

    def ranks(tp: TensorParallel):
        x = torch.full((2, 3), float(tp.rank + 1))
        reduced = tp.all_reduce(x.clone())
        gathered = tp.gather_last_dim(x)
        samples = tp.broadcast(torch.tensor([7, 8]) if tp.is_first else torch.zeros(2, dtype=torch.int64))
        if tp.is_first:
            for message in (b"", b"step", long):
                tp.publish(message)
            received = None
        else:
            received = [tp.receive() for _ in range(3)]
        return reduced, gathered, samples, received, tp.agree_min(100 - tp.rank)

    out = in_threads(3, ranks)
    for rank in range(3):
        reduced, gathered, samples, received, smallest = out[rank]
        assert torch.equal(reduced, torch.full((2, 3), 6.0)) and samples.tolist() == [7, 8] and smallest == 98
        assert (gathered is None) == (rank > 0) and (rank == 0 or received == [b"", b"step", long])
    assert out[0][1].tolist() == [[1.0] * 3 + [2.0] * 3 + [3.0] * 3] * 2


@pytest.mark.parametrize(
    ("name", "size"),
    [("qwen3", 2), ("qwen3", 4), ("gemma3", 2), ("gpt_oss", 2), ("glm4", 2), ("phi3", 2), ("llama4", 2),
     ("ernie4_5_moe", 2), ("apertus", 2)],
)  # fmt: skip
def test_each_rank_loads_its_shard_and_together_they_compute_the_whole_model(name, size, request, tmp_path):
    # Contexts past the windows (Gemma 3's 24, gpt-oss's 16 with its sinks, split by head; Phi-3's fused
    # checkpoint tensors and GLM-4's permuted rotary dims, split by rank).
    path = request.getfixturevalue("qwen3_dir") if name == "qwen3" else make_tiny_model(tmp_path, **TINY_PRESETS[name])
    spec = spec_of(path)

    def forward(tp: TensorParallel):
        model = load_model(spec, LayerKernels(TorchAttention()), path, dtype=torch.float32, device=CPU, tp=tp)
        kv = allocate_kv_pool(spec, 24, 8, torch.float32, CPU, model.shard.num_kv_heads)
        chunks = []
        for i, (cached, new) in enumerate([(0, 41), (30, 1), (0, 20)]):
            seq = Sequence(f"s{i}", list(range(3 + i, 3 + i + cached + new)), SamplingParams(), max_tokens=1,
                           sampling_seed=0, stop_token_ids=frozenset())  # fmt: skip
            seq.block_table = list(range(8 * i, 8 * i + 8))
            chunks.append(WarmupChunk(seq, cached, new))
        inputs = pack_step(chunks, 8, CPU)
        with torch.inference_mode():
            hidden = model(inputs.input_ids, inputs.positions, ForwardContext(inputs.meta, kv))
            return model, model.compute_logits(hidden[inputs.sample_rows])

    _, expected = forward(SINGLE)
    out = in_threads(size, forward)
    d, hkv_local = spec.head_dim, max(1, spec.num_kv_heads // size)
    for rank, (model, logits) in out.items():
        qkv = model.model.layers[0].self_attn.qkv_proj.weight
        assert qkv.shape[0] == (spec.num_heads // size + 2 * hkv_local) * d  # only this rank's rows were read
        assert model.model.embed_tokens.weight.shape[0] == spec.vocab_size // size
        assert (logits is None) == (rank > 0)
    # The row-parallel sums add in another order: equal to float32 rounding, and the same greedy tokens.
    torch.testing.assert_close(out[0][1], expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[0][1].argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_moe_ranks_hold_every_experts_slice_and_reduce_once_per_layer(name, tmp_path, monkeypatch):
    path = make_tiny_model(tmp_path, **TINY_PRESETS[name])
    spec = spec_of(path)
    reduces = threading.local()
    plain = TensorParallel.all_reduce

    def counted(self, x):
        reduces.n = getattr(reduces, "n", 0) + 1
        return plain(self, x)

    monkeypatch.setattr(TensorParallel, "all_reduce", counted)

    def forward(tp: TensorParallel):
        model = load_model(spec, LayerKernels(TorchAttention()), path, dtype=torch.float32, device=CPU, tp=tp)
        kv = allocate_kv_pool(spec, 16, 8, torch.float32, CPU, model.shard.num_kv_heads)
        chunks = []
        for i, (cached, new) in enumerate([(0, 30), (8, 1), (0, 3)]):
            seq = Sequence(f"s{i}", list(range(3 + i, 3 + i + cached + new)), SamplingParams(), max_tokens=1,
                           sampling_seed=0, stop_token_ids=frozenset())  # fmt: skip
            seq.block_table = list(range(4 * i, 4 * i + 4))
            chunks.append(WarmupChunk(seq, cached, new))
        inputs = pack_step(chunks, 8, CPU)
        reduces.n = 0
        with torch.inference_mode():
            hidden = model(inputs.input_ids, inputs.positions, ForwardContext(inputs.meta, kv))
            logits = model.compute_logits(hidden[inputs.sample_rows])
        return model, logits, reduces.n

    _, expected, none = forward(SINGLE)
    assert none == 0
    out = in_threads(2, forward)
    moe, layer = spec.moe, spec.moe.layers[0]
    for model, _, count in out.values():
        experts = model.model.layers[layer].mlp.experts
        assert experts.w13.shape == (moe.num_experts, moe.intermediate_size, spec.hidden_size)  # 2 x I/2 rows
        assert experts.w2.shape == (moe.num_experts, spec.hidden_size, moe.intermediate_size // 2)
        assert count == 1 + 2 * spec.num_layers  # the embedding, then o_proj and the MLP (dense or MoE) per layer
    torch.testing.assert_close(out[0][1], expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[0][1].argmax(-1), expected.argmax(-1))


# ---- the step mirror -------------------------------------------------------------------------------


class Samples:
    """A launched step's samples as the next step's packing reads them (``step_inputs.PendingSource``)."""

    def __init__(self, rows: dict, token_ids: list[int]) -> None:
        self.rows, self.out = rows, SamplerOutput(torch.tensor(token_ids, dtype=torch.int64), None, None, None)


def test_workers_pack_every_step_as_rank_0_does_through_preemption_prefix_hits_and_reused_ids():
    # A real scheduler and block manager run short of blocks: each step's message, through msgpack, must
    # give a worker the same packed inputs (ids, positions, slots, block tables) as rank 0's own chunks.
    bm = BlockManager(14, 4, enable_prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=12, max_model_len=64)
    rng = random.Random(3)
    shared = [rng.randrange(3, 100) for _ in range(9)]

    def add(rid: str, n: int) -> None:
        prompt = shared + [rng.randrange(3, 100) for _ in range(n)]
        sched.add(
            Sequence(rid, prompt, SamplingParams(), max_tokens=6 + n, sampling_seed=0, stop_token_ids=frozenset())
        )

    for i in range(5):
        add(f"r{i}", 2 + 3 * i)
    writer, reader = StepWriter(), StepReader()
    in_flight = None  # (chunks, rank 0's samples, the worker's, the token ids)

    def resolve() -> None:
        chunks, *_, tokens = in_flight
        sched.resolve(chunks, dict(zip((c.seq.request_id for c in chunks if c.samples), tokens)))

    for step in range(80):
        if step == 6:
            sched.finish("r1", "abort")
        if step == 9:
            add("r1", 4)  # the id again, a new sequence
        chunks = sched.schedule()
        if not chunks:  # the last samples are still in flight, or everything has finished
            if in_flight is None:
                break
            resolve()
            in_flight = None
            continue
        mirrored = reader.chunks(decode(encode(writer.step(chunks))))
        ours = pack_step(chunks, 4, CPU, in_flight and in_flight[1])
        theirs = pack_step(mirrored, 4, CPU, in_flight and in_flight[2])
        for a, b in [(ours.input_ids, theirs.input_ids), (ours.positions, theirs.positions)] + [
            (getattr(ours.meta, f), getattr(theirs.meta, f)) for f in ("slot_mapping", "seq_lens", "block_tables")
        ]:
            assert torch.equal(a, b), step
        assert ours.sample_rows == theirs.sample_rows
        sampling = [c for c in chunks if c.samples]
        tokens = [rng.randrange(3, 100) for _ in sampling]
        sched.launched(chunks)
        if in_flight is not None:
            resolve()
        rows0 = {c.seq.request_id: i for i, c in enumerate(sampling)}
        rows1 = {c.seq.request_id: i for i, c in enumerate(m for m in mirrored if m.samples)}
        in_flight = (chunks, Samples(rows0, tokens), Samples(rows1, tokens), tokens)
    assert not sched.requests, "the run ended before every request finished"
    assert sched.num_preemptions > 0 and sched.num_prefix_hits > 0
    assert len(reader._tables) <= 1  # the finished sequences were forgotten (the last may still be known)


# ---- whole engines (worker processes) ----------------------------------------------------------------


@pytest.fixture(scope="module")
def preset_dirs(tmp_path_factory):
    names = ("llama", "mistral", "qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe", "minimax_m2", "llama4")
    return {name: make_tiny_model(tmp_path_factory.mktemp(name), **TINY_PRESETS[name]) for name in names}


@pytest.fixture(scope="module")
def reference():
    """tp=1 outputs of the workload, by model directory (one in-process engine each)."""
    outputs = {}

    def get(path, options=ENGINE) -> list[list[int]]:
        if path not in outputs:
            with LLM(str(path), **options) as llm:
                outputs[path] = [o.token_ids for o in llm.generate(workload(), GREEDY, use_tqdm=False)]
        return outputs[path]

    return get


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "size"),
    [
        ("qwen3", 2),
        ("qwen3", 4),
        ("qwen2", 2),
        ("qwen2", 4),
        ("llama", 2),
        ("mistral", 2),
        ("qwen3_moe", 2),
        ("qwen2_moe", 2),
        ("mixtral", 2),
        ("glm4_moe", 2),
        ("minimax_m2", 2),
        ("llama4", 2),
    ],
)
def test_generate_is_token_identical_to_one_rank(model, size, request, preset_dirs, reference):
    path = preset_dirs.get(model) or request.getfixturevalue(f"{model}_dir")
    before = set(children(os.getpid()))
    # Llama 4's 4 layers are 4 KV groups (its chunked layers beside the global one) of a layer a block
    options = {**ENGINE, "num_kvcache_blocks": 48} if model == "llama4" else ENGINE
    with LLM(str(path), tensor_parallel_size=size, **options) as llm:
        workers = set(children(os.getpid())) - before
        assert len(workers) == size - 1
        got = [o.token_ids for o in llm.generate(workload(), GREEDY, use_tqdm=False)]
        stats = llm.engine.stats()
    assert got == reference(path, options)
    assert stats.preemptions > 0 and stats.prefix_cache_hits > 0 and stats.steps["mixed"] > 0
    assert not any(alive(w) for w in workers)  # close() stopped the workers


@pytest.mark.slow
def test_a_dead_worker_fails_the_next_generate_and_leaves_nothing_behind(qwen3_dir, reference):
    before = set(children(os.getpid()))
    with LLM(str(qwen3_dir), tensor_parallel_size=2, worker_timeout=2.0, **ENGINE) as llm:
        (worker,) = set(children(os.getpid())) - before
        os.kill(worker, signal.SIGKILL)  # while the engine idles: the watch sees it
        with pytest.raises(EngineDeadError, match=rf"worker rank 1 \(pid {worker}\) was killed by SIGKILL"):
            llm.generate(workload(), GREEDY, use_tqdm=False)
    assert set(children(os.getpid())) <= before


async def stream_all(address: str, prompts: list[list[int]]) -> list[list[int]]:
    """Every prompt streamed at once from one client; each stream's token ids, in prompt order."""
    async with AsyncClient(address) as client:
        outputs = [[] for _ in prompts]

        async def one(i: int) -> None:
            async for chunk in client.stream(prompts[i], GREEDY):
                outputs[i] += chunk.token_ids

        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)
    return outputs


@pytest.mark.slow
def test_two_tp2_engines_at_once_stream_what_one_rank_generates(qwen3_dir, reference):
    # Each engine hosts its store on a port the OS gave it: started at the same moment, they never meet.
    options = {**ENGINE, "tensor_parallel_size": 2}
    with engine_processes(str(qwen3_dir), {"a": options, "b": options}) as engines:
        for engine in engines.values():
            assert len(children(engine.pid)) == 1
        results = [run_in_thread(stream_all, e.address, workload()) for e in engines.values()]
        workers = [w for e in engines.values() for w in children(e.pid)]
    assert results == [reference(qwen3_dir)] * 2
    assert not any(alive(w) for w in workers)  # stopping an engine stopped its worker


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["SIGKILL", "SIGSTOP"])
def test_a_worker_killed_or_stopped_mid_stream_ends_every_stream_with_engine_dead(qwen3_dir, sig):
    timeout = 2.0
    options = {**ENGINE, "max_model_len": 2048, "num_kvcache_blocks": 1024, "tensor_parallel_size": 2}
    with engine_processes(str(qwen3_dir), {"tp": {**options, "worker_timeout": timeout}}) as engines:
        engine = engines["tp"]
        (worker,) = children(engine.pid)

        async def main() -> list[tuple[int, float]]:
            ended: list[tuple[int, float]] = []  # per stream: tokens received, seconds after the signal
            async with AsyncClient(engine.address, timeout=30) as client:  # the engine, not silence, says it

                async def one(i: int) -> None:
                    received = 0
                    with pytest.raises(EngineDeadError, match="worker rank 1"):
                        async for chunk in client.stream(
                            [5 + i, 6, 7], max_tokens=1900, temperature=0, ignore_eos=True
                        ):
                            received += len(chunk.token_ids)
                    ended.append((received, time.monotonic() - killed))

                async with anyio.create_task_group() as tg:
                    for i in range(3):
                        tg.start_soon(one, i)
                    await anyio.sleep(1.0)
                    killed = time.monotonic()
                    os.kill(worker, sig)
            return ended

        ended = run_in_thread(main)
        assert engine.proc.wait(20) == 1  # the engine process exits, saying why
    assert len(ended) == 3 and all(n > 0 for n, _ in ended)
    assert all(after < timeout + 3.0 for _, after in ended), ended
    assert not alive(worker), "the stopped worker was left behind"
    assert ("killed by SIGKILL" if sig == signal.SIGKILL else "no heartbeat for") in engine.output()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_hosts_torchrun_style_serve_a_streaming_client(qwen3_dir, reference):
    # Two launches with torchrun's variables and the same MASTER_ADDR/MASTER_PORT, one rank each, as two
    # hosts would run them (here both on this one). Rank 0 is the engine; rank 1 takes its options from it.
    port, procs = free_port(), {}
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE.items()]
    for rank in (1, 0):  # the worker first: it waits for rank 0's store
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank),
                   LOCAL_RANK="0", PYTHONUNBUFFERED="1")  # fmt: skip
        cmd = [sys.executable, "-m", "nanostream", "serve", str(qwen3_dir), "--tensor-parallel-size", "2", *flags]
        procs[rank] = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    logs = {rank: [] for rank in procs}
    ready = threading.Event()

    def pump(rank: int) -> None:  # read each launch's output as it comes (a full pipe would stall it)
        for line in procs[rank].stdout:
            logs[rank].append(line)
            if line.startswith(READY):
                ready.set()

    for rank in procs:
        threading.Thread(target=pump, args=(rank,), daemon=True).start()
    try:
        assert ready.wait(120), "".join(logs[0] + logs[1])
        address = next(line[len(READY) :].strip() for line in logs[0] if line.startswith(READY))
        assert run_in_thread(stream_all, address, workload()) == reference(qwen3_dir)
    finally:
        procs[0].terminate()
        codes = {rank: proc.wait(30) for rank, proc in procs.items()}
    # rank 0 shut down cleanly and told rank 1 to stop (rank 1's last lines say how it ended if it did not)
    assert codes == {0: 0, 1: 0}, "".join(logs[1][-40:])
    assert any("worker rank 1 stopping: the engine closed" in line for line in logs[1])
