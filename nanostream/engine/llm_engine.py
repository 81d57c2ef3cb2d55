"""The engine core: admission, one ``step()`` of scheduling + model + bookkeeping, abort.

Token ids in, token ids out; no tokenizer, no I/O. The offline ``LLM`` and the engine process both drive it by
calling ``step()`` in a loop. A step is launched on the device before the previous one's samples are read back, so
the host's scheduling and bookkeeping overlap the GPU's work; ``step()`` returns the previous step's tokens.

With ``tensor_parallel_size`` N > 1 this process is rank 0: it starts (or, with torchrun's ``rendezvous``,
meets) N-1 workers (engine/tp/workers.py) before its runner; their death is the engine's (``EngineDeadError``).
"""

from __future__ import annotations

import logging
import random
import time

import torch

from nanostream.config import EngineConfig
from nanostream.distributed.rendezvous import Rendezvous
from nanostream.engine.admission import check_request, read_eos_token_ids
from nanostream.engine.block_manager import BlockManager
from nanostream.engine.deltas import StepResult, ended_delta, token_delta
from nanostream.engine.grammar import GrammarCompiler, GrammarMasks, GrammarWaitlist
from nanostream.engine.images import check_images
from nanostream.engine.runner.model_runner import InFlight, ModelRunner
from nanostream.engine.scheduler import ScheduledChunk, Scheduler
from nanostream.engine.sequence import Sequence
from nanostream.engine.state_slots import StateSlots
from nanostream.engine.stats import StepCounters
from nanostream.engine.tp.workers import WorkerGroup, agreed_config
from nanostream.errors import EngineDeadError, InvalidRequestError
from nanostream.models import decoder_spec
from nanostream.models.loader import resolve_model_path
from nanostream.models.model_config import read_model_config
from nanostream.models.pooling import read_pooling
from nanostream.models.quantization import weights_dtype
from nanostream.models.vision.tower import vision_tower
from nanostream.protocol import EngineStats, RequestDelta
from nanostream.sampling_params import SamplingParams

log = logging.getLogger(__name__)

GRAMMAR_WAIT_S = 0.01
"""With nothing to compute but grammars compiling, a step waits this long for one (not a busy spin)."""
MAX_FAILED_STEPS = 3
"""Steps in a row that may raise before ``step()`` gives up: past this the device or the engine is
broken (a sticky CUDA error), not one request."""


class LLMEngine:
    """Example::

    engine = LLMEngine(EngineConfig(model="/models/Qwen3-0.6B"))
    engine.add_request("r1", [9707, 11], SamplingParams(max_tokens=8))
    while engine.has_unfinished():
        for delta in engine.step().deltas: ...
    engine.close()  # stops tensor-parallel workers, if any

    ``rendezvous``: torchrun's variables, read by the process's entry point, when this process is rank 0 of
    ranks launched by torchrun; without it the workers are started here.
    """

    def __init__(self, config: EngineConfig, rendezvous: Rendezvous | None = None) -> None:
        self.model_path = resolve_model_path(config.model)
        model = read_model_config(self.model_path)  # refuses an architecture or a config it cannot run, by name
        text = model.text  # a multimodal checkpoint's language model
        self.config = config = config.resolve(
            max_position_embeddings=text.max_position_embeddings,
            cuda_available=torch.cuda.is_available(),
        )
        spec = decoder_spec(model.hf_config, max_model_len=config.max_model_len)
        self.vision, self.mrope = vision_tower(model), spec.rope.mrope_section is not None
        self.workers: WorkerGroup | None = None
        if config.tensor_parallel_size == 1:
            self.runner = ModelRunner(config, spec, self.model_path, vision=self.vision)
        else:
            self.config = config = agreed_config(config, spec, rendezvous.local_rank if rendezvous else 0)
            self.workers = WorkerGroup(config, spec, rendezvous, self.vision)
            try:
                self.runner = ModelRunner(
                    config, spec, self.model_path, tp=self.workers.tp, control=self.workers, vision=self.vision
                )
            except Exception as exc:  # none of the ranks can go on without the others
                error = self.workers.failed_to_start(exc)
                if error is exc:
                    raise
                raise error from exc
        self.vocab_size = self.runner.vocab_size
        self.eos_token_ids = read_eos_token_ids(self.model_path, text)
        self.pooling = read_pooling(self.model_path, config.runner)  # None: no embeddings (a generation model)
        # recurrent layers: a live state slot per running sequence, and snapshots for the prefix cache
        states = StateSlots.of_model(config, self.runner.num_state_snapshots, self.runner.state_slot_bytes)
        self.block_manager = BlockManager(  # a block table per KV group, each giving blocks back by its reach
            self.runner.num_kv_blocks, config.kvcache_block_size, config.enable_prefix_caching, states,
            config.state_snapshot_interval, max_chunk=config.max_num_batched_tokens,
            groups=self.runner.layout.group_reaches,
        )  # fmt: skip
        self.scheduler = Scheduler(
            self.block_manager, max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
        )  # fmt: skip
        self._rng = random.Random(config.seed)
        grammars = GrammarCompiler(config.tokenizer or self.model_path, self.vocab_size, self.eos_token_ids)
        self.grammar_waitlist = GrammarWaitlist(grammars)  # constrained requests whose grammar compiles
        self.grammar_masks = GrammarMasks()  # a step's masks of its constrained rows
        self._in_flight: tuple[list[ScheduledChunk], InFlight] | None = None  # the launched, unread step
        self._scheduled: list[ScheduledChunk] = []  # this step's chunks, until it is in flight
        self._deltas: list[RequestDelta] = []  # this step's output so far
        self._failed_steps = 0  # in a row
        self._counters = StepCounters()
        log.info(
            "engine ready: %s on %s (%s), %d KV blocks of %d tokens (%s)%s%s", self.model_path, config.device,
            weights_dtype(self.runner.model), self.block_manager.num_blocks, config.kvcache_block_size,
            str(self.runner.kv_dtype).removeprefix("torch."), ", batch-invariant" if config.batch_invariant else "",
            f", embeddings ({self.pooling.mode}-token pooling)" if self.pooling else "",
        )  # fmt: skip
        # The collector is the process's, not the engine's: the engine process (`nanostream serve`) and the
        # benchmarks freeze what start-up made (gc.freeze(): a full pass over it stalled a step for 280 ms
        # on an H200); a program of one's own may do the same after building its LLM.

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    @property
    def failure(self) -> str | None:
        """Why the engine cannot go on (a tensor-parallel worker died or hung); None while it can."""
        return self.workers.failure if self.workers is not None else None

    def close(self) -> None:
        """Stop the tensor-parallel workers (nothing to do at one rank). The engine cannot step afterwards."""
        if self.workers is not None:
            self.workers.close()

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, images=()) -> None:
        """Queue a request, or raise ``InvalidRequestError`` if it can never run (nothing else changes). ``images``:
        a vision-language model's ``ImageInput``s, as its image processor prepared them (engine/images.py).
        A constrained request (``structured_outputs``) waits for its grammar, compiled off this thread; a
        grammar that does not compile ends it with an "error" delta of code "invalid"."""
        prompt = list(prompt_token_ids)
        pooling = self.pooling is not None
        max_tokens = check_request(prompt, params, self.vocab_size, self.max_model_len, self.block_manager, pooling)
        if params.prompt_logprobs is not None and self.config.tensor_parallel_size > 1:
            raise InvalidRequestError(
                "prompt_logprobs is not supported with tensor_parallel_size > 1 yet; leave it out or run one rank"
            )
        images = check_images(prompt, images, self.vision, self.config, mrope=self.mrope)
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        seq = Sequence(
            request_id, prompt, params, max_tokens=max_tokens, sampling_seed=seed & (2**63 - 1), stop_token_ids=stop_ids
        )
        seq.images = images
        if request_id in self.grammar_waitlist or request_id in self.scheduler.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if params.structured_outputs is not None and not self.grammar_waitlist.add(seq):
            return  # it joins the scheduler once its grammar is compiled (_admit_compiled)
        self.scheduler.add(seq)

    def _admit_compiled(self, wait: float) -> list[RequestDelta]:
        """Move the requests whose grammar is ready into the scheduler; end those whose grammar failed."""
        deltas = []
        for seq, exc in self.grammar_waitlist.take_ready(wait):
            if exc is None:
                self.scheduler.add(seq)
                continue
            invalid = isinstance(exc, InvalidRequestError)
            if not invalid:
                log.error("compiling the grammar of request %s failed", seq.request_id, exc_info=exc)
            error = str(exc) if invalid else f"internal error while compiling the grammar ({exc!r})"
            code = "invalid" if invalid else "internal"
            self._counters.finished["error"] += 1
            deltas.append(ended_delta(seq, "error", error, code))
        return deltas

    def abort(self, request_id: str, reason: str = "abort") -> RequestDelta | None:
        """Finish a request in any state, freeing its KV blocks now. Unknown or finished ids are ignored."""
        seq = self.scheduler.finish(request_id, reason)
        if seq is None:
            seq = self.grammar_waitlist.pop(request_id)
        if seq is None:
            return None
        self._counters.finished[reason] += 1
        return ended_delta(seq, reason)

    def stats(self) -> EngineStats:
        """The engine's counters since it started (steps, step time, tokens, preemptions, prefix cache)."""
        sched = self.scheduler
        return self._counters.snapshot(
            preemptions=sched.num_preemptions,
            prefix_cache_queries=sched.num_prefix_queries,
            prefix_cache_hits=sched.num_prefix_hits,
            device_wait_seconds=self.runner.device_wait_seconds,
        )

    def has_unfinished(self) -> bool:
        return len(self.scheduler) > 0 or len(self.grammar_waitlist) > 0

    @property
    def num_waiting(self) -> int:
        """Requests that do not run yet: queued in the scheduler, or waiting for their grammar to compile."""
        return len(self.scheduler.waiting) + len(self.grammar_waitlist)

    @property
    def num_waiting_tokens(self) -> int:
        """Prompt tokens of the requests that do not run yet (preempted ones: every token they hold)."""
        return self.scheduler.num_waiting_tokens + self.grammar_waitlist.num_prompt_tokens

    def step(self) -> StepResult:
        """Launch one step and return what the previous one produced (read back while this one runs).

        If stepping raises, the requests of the failed step (and of the one in flight) end with
        finish_reason "error" and the engine serves on; after ``MAX_FAILED_STEPS`` failures in a row
        the exception propagates. ``EngineDeadError`` (tensor parallelism: a rank is gone) propagates at once."""
        start = time.perf_counter()
        try:
            result = self._step()
        except EngineDeadError:  # a worker died or hung: no step can run again
            raise
        except Exception as exc:
            self._failed_steps += 1
            if self._failed_steps >= MAX_FAILED_STEPS:
                raise
            return self._fail_step(exc)
        self._failed_steps = 0
        self._counters.step(
            time.perf_counter() - start, result.num_requests, result.num_prefill_tokens, result.num_decode_tokens
        )
        return result

    def _fail_step(self, exc: Exception) -> StepResult:
        log.exception("an engine step failed; failing its requests, serving the others")
        chunks = self._scheduled + (self._in_flight[0] if self._in_flight else [])
        self._scheduled, self._in_flight = [], None
        error = f"internal error while running the request ({type(exc).__name__}: {exc}); the engine logged it"
        deltas = self._deltas  # what the step produced before it failed still goes out
        for rid in dict.fromkeys(c.seq.request_id for c in chunks):
            seq = self.scheduler.finish(rid, "error")
            if seq is not None:
                self._counters.finished["error"] += 1
                deltas.append(ended_delta(seq, "error", error, "internal"))
        return StepResult(deltas, 0, 0)

    def _step(self) -> StepResult:
        deltas = self._deltas = []
        if self.grammar_waitlist:  # constrained requests whose grammar is ready join the scheduler
            idle = not self.scheduler.requests and self._in_flight is None
            deltas += self._admit_compiled(GRAMMAR_WAIT_S if idle else 0.0)
        # 0. a request whose penalties read its own output needs every token's value before scheduling
        if self._in_flight is not None and self.scheduler.needs_token_values():
            deltas += self._finish_in_flight()
        # 1. pick this step's chunks (decodes first, then prefill chunks, then admissions)
        chunks = self._scheduled = self.scheduler.schedule()
        num_decode = sum(1 for c in chunks if c.num_new_tokens == 1 and c.start >= c.seq.num_prompt_tokens)
        num_prefill = sum(c.num_new_tokens for c in chunks) - num_decode
        # 2. queue the model and the sampler on the device; inputs still in flight stay on the device. A
        # constrained row's mask needs the token the step in flight samples: its sampling waits for 4.
        launched, deferred = None, False
        if chunks:
            if self.scheduler.num_constrained:
                deferred = any(c.samples and c.seq.grammar is not None for c in chunks)
            prev = self._in_flight[1] if self._in_flight else None
            options = {"defer_sampling": True} if deferred else {}
            if self.scheduler.num_prompt_logprobs:
                options["with_prompt_logprobs"] = True
            launched = self.runner.launch(chunks, prev, **options)
            self.scheduler.launched(chunks)
        # 3. read back the previous step's samples while this one runs; finish requests that stop
        if self._in_flight is not None:
            deltas += self._finish_in_flight()
        self._in_flight = (chunks, launched) if chunks else None
        self._scheduled = []
        # 4. the grammars took those tokens: mask the constrained rows and queue the sampling
        if deferred:
            self._sample_constrained(launched)
        return StepResult(deltas, num_prefill, num_decode, len(chunks))

    def _sample_constrained(self, step: InFlight) -> None:
        """Sample a step launched with its sampling deferred, the masks of its live grammars applied."""
        live = [(i, s.grammar) for i, s in enumerate(step.seqs) if s.grammar is not None and not s.is_finished]
        if not live:  # every constrained row stopped on the previous token: its sample is dropped
            self.runner.sample(step)
            return
        rows, grammars = zip(*live)
        self.runner.sample(step, rows, self.grammar_masks.fill(list(grammars), pin=self.runner.device.type == "cuda"))

    def _finish_in_flight(self) -> list[RequestDelta]:
        chunks, launched = self._in_flight
        sampled = self.runner.collect(launched)
        self._in_flight, now = None, time.monotonic()
        deltas = []
        for seq in self.scheduler.resolve(chunks, {rid: s.token_id for rid, s in sampled.items()}):
            if not seq.reported:
                self._counters.first_token(seq.arrived, seq.admitted_at, now)
            if seq.finish_reason is not None:
                self._counters.finished[seq.finish_reason] += 1
            deltas.append(token_delta(seq, sampled[seq.request_id]))
        self._counters.generation_tokens += len(deltas)
        return deltas
