"""Runs the model on a device: builds it with its kernels, owns the KV pool, launches steps, reads samples.

The runner knows nothing of scheduling: it gets the step's chunks (which tokens of which sequences to compute,
``step_inputs.Chunk``) and returns the token sampled for every sequence whose chunk reached its end. Its helpers, by
job: kv_pool.py (how many blocks, the allocation), step_inputs.py (packing a step), image_rows.py (images),
sampling_batch.py (sampling parameters as tensors, samples read back), decode_graphs.py, prefill_graphs.py (graphs).

With tensor parallelism every rank has a runner over its shard of the model. Rank 0's ``launch`` first
publishes the step to the others (``control``: engine/tp/workers.py); every rank then runs it
(``launch_local``) in lockstep: the same packed inputs, the same CUDA-graph bucket, the same collectives.
Rank 0 gathers the logits and samples (and pools embeddings: pooled.py); its samples are broadcast, since
the next step may read them as inputs. The warm-up and graph captures run on every rank alike, unannounced."""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import torch

from nanostream.config import EngineConfig
from nanostream.distributed.group import SINGLE, TensorParallel
from nanostream.engine.runner.cache_pool import CacheLayout, allocate_caches, init_states
from nanostream.engine.runner.decode_graphs import DecodeGraphs
from nanostream.engine.runner.image_rows import ImageRows, received_inputs
from nanostream.engine.runner.in_flight import InFlight, StepControl, copy_to_host
from nanostream.engine.runner.kv_pool import kv_dtype, measure_cuda_kv_budget, plan_cache, short_chunk_steps, worst_step
from nanostream.engine.runner.pooled import launch_pooling
from nanostream.engine.runner.prefill_graphs import PrefillGraphs
from nanostream.engine.runner.prompt_logprobs import launch_prompt_logprobs
from nanostream.engine.runner.sampler import SamplerOutput, sample, warm_lm_head
from nanostream.engine.runner.sampling_batch import SampledToken, add_token_bitmask, make_sampling_batch, read_samples
from nanostream.engine.runner.step_inputs import Chunk, StepInputs, Uploads, pack_states, pack_step, to_device
from nanostream.layers.attention import ForwardContext
from nanostream.layers.attention_backend import AttentionMetadata, KVCache
from nanostream.layers.backends import get_backend
from nanostream.layers.cache_spec import StateCache, StateMetadata
from nanostream.layers.delta_rule_fla import fla_runs, varlen_delta_rule
from nanostream.layers.layer_kernels import LayerKernels
from nanostream.models import DecoderSpec, PlaceholderEmbeds, load_model
from nanostream.models.vision.tower import VisionTower

__all__ = ["InFlight", "ModelRunner", "SampledToken"]

log = logging.getLogger(__name__)


class ModelRunner:
    """``tp``: this process's rank (default: the only one); ``control``: on rank 0 of several, the workers;
    ``vision``: a vision-language model's tower (image_rows.py); ``image_levels``: a worker's of one (image_rows.py)."""

    def __init__(
        self,
        config: EngineConfig,
        spec: DecoderSpec,
        model_path: Path,
        *,
        tp: TensorParallel = SINGLE,
        control: StepControl | None = None,
        vision: VisionTower | None = None,
        image_levels: tuple[int, bool] | None = None,
    ) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = getattr(torch, config.dtype)
        self.kv_dtype = kv_dtype(config, spec)  # the KV pool's: the model's, or float8 e4m3
        self.block_size, self.spec = config.kvcache_block_size, spec
        if config.batch_invariant and spec.latent_attention is not None:  # decode absorbed, prompt rows expanded
            raise ValueError("batch_invariant does not run latent attention (MLA) yet: leave batch_invariant off")
        self.vocab_size = self.spec.vocab_size
        self.device_wait_seconds = 0.0  # the host waiting for the device in collect(), summed
        self.tp, self.control = tp, control
        self.uploads = Uploads(self.device)  # host memory of this runner's uploads (step_inputs.py)
        cuda = self.device.type == "cuda"
        self.backend = get_backend(
            config.attention_backend, self.device, dtype=self.dtype, block_size=self.block_size,
            head_dim=self.spec.head_dim, kv_cache_dtype=self.kv_dtype, batch_invariant=config.batch_invariant,
        )  # fmt: skip
        kernels = LayerKernels.for_backend(
            self.backend, compile=cuda and config.torch_compile, batch_invariant=config.batch_invariant
        )
        if cuda:  # Gated DeltaNet, short convolutions: decode steps in place at the state slots; prompts through fla
            from nanostream.kernels.gated_delta_decode import decode_step, short_conv_decode

            prompts = varlen_delta_rule if fla_runs(self.device, self.dtype) and not config.batch_invariant else None
            decode = dict(delta_decode=decode_step, conv_decode=short_conv_decode)
            kernels = dataclasses.replace(kernels, delta_rule=prompts, **decode)
        self.model = load_model(
            self.spec, kernels, model_path, dtype=self.dtype, device=self.device, tp=tp,
            load_format=config.load_format, keep_fp8=False if config.batch_invariant else None,
        )  # fmt: skip
        self.images = None if vision is None else ImageRows.of(vision, model_path, config, self.dtype, self.device)
        self.image_width = None if image_levels is None else (spec.hidden_size, self.dtype, *image_levels)
        self.num_kv_heads = self.model.shard.num_kv_heads  # this rank's
        self.layout = CacheLayout(self.model.cache_specs())  # which layers page KV, which keep a state
        self.graphs: DecodeGraphs | None = None  # captured once the KV pool exists
        self.prefill_graphs: PrefillGraphs | None = None
        self.num_state_snapshots = 0  # (the worst step's pool, if it runs, holds the live slots alone)
        self.num_kv_blocks, self.num_state_snapshots = plan_cache(
            config, self.kv_block_bytes, self.state_slot_bytes, self.device, self._cuda_kv_budget,
            len(self.layout.groups),
        )  # fmt: skip
        if cuda and (config.num_kvcache_blocks is not None or config.kv_cache_memory_bytes is not None):
            self._run_worst_step()  # the pool's size was given, so no measurement ran it: it still compiles
        if tp.size > 1:  # every rank's pool has as many blocks and slots: the scheduler's ids index them all
            self.num_kv_blocks = tp.agree_min(self.num_kv_blocks)
            self.num_state_snapshots = tp.agree_min(self.num_state_snapshots)
        self.kv_caches = self._allocate_kv(self.num_kv_blocks)
        if cuda:  # every rank runs them alike: no control message
            for chunks in short_chunk_steps(config, self.num_kv_blocks):
                self.collect(self.launch_local(chunks))
        graphs = cuda and not config.enforce_eager
        if graphs and self.backend.supports_cuda_graphs:
            self.graphs = DecodeGraphs(
                self._forward,
                max_num_seqs=config.max_num_seqs,
                max_model_len=config.max_model_len,
                block_size=self.block_size,
                device=self.device,
                states=self.layout.has_state,
                num_groups=len(self.layout.groups),
            )
        if graphs and tp.size == 1 and not self.layout.has_state and self.model.model.piecewise:  # (host bookkeeping)
            self.prefill_graphs = self._capture_prefill_graphs()
        if cuda:
            warm_lm_head(self.model, config.max_num_seqs, self.spec.hidden_size, self.dtype, self.device)

    def _capture_prefill_graphs(self) -> PrefillGraphs | None:
        # Their buffers and pool come out of the memory the KV pool left (1 - gpu_memory_utilization).
        try:
            return PrefillGraphs(self.model.model, max_tokens=self.config.max_num_batched_tokens, device=self.device)
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            log.warning(
                "no memory left for the prefill CUDA graphs: steps with prompt tokens run eagerly "
                "(lower gpu_memory_utilization to leave room for them)"
            )
            return None

    # ---- KV pool -------------------------------------------------------------------------------

    @property
    def kv_block_bytes(self) -> int:
        return self.layout.kv_block_bytes(self.block_size, self.kv_dtype)

    @property
    def state_slot_bytes(self) -> int:
        """One sequence's state in every recurrent layer (0: the model has none)."""
        return self.layout.slot_bytes(self.dtype)

    def describe_cache(self) -> str:
        """What its pools hold, in a line (``nanostream serve`` prints it)."""
        return self.layout.describe(
            self.num_kv_blocks, self.block_size, self.config.max_num_seqs, self.num_state_snapshots,
            self.state_slot_bytes,
        )  # fmt: skip

    def _allocate_kv(self, num_blocks: int) -> list[KVCache | StateCache]:
        slots = self.config.max_num_seqs + self.num_state_snapshots if self.layout.has_state else 0
        return allocate_caches(
            self.layout, num_blocks=num_blocks, block_size=self.block_size, kv_dtype=self.kv_dtype,
            num_slots=slots, model_dtype=self.dtype, device=self.device,
        )  # fmt: skip

    def _cuda_kv_budget(self) -> int:
        return measure_cuda_kv_budget(self.device, self.config.gpu_memory_utilization, self._run_worst_step)

    def _run_worst_step(self) -> None:
        """The step that peaks memory, on a pool of its own (freed after), and the largest image batch: they measure
        the KV budget and compile the longest chunks' kernels (FlashAttention-4's variants) before the first prompt."""
        if self.images is not None:
            self.images.encode_largest(self.device)
        num_blocks, chunks = worst_step(self.config)
        self.kv_caches = self._allocate_kv(num_blocks)
        self.collect(self.launch_local(chunks))  # every rank runs it: no control message
        del self.kv_caches

    # ---- one step ------------------------------------------------------------------------------

    def _forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, states: StateMetadata = None,
        embeds: PlaceholderEmbeds | None = None,
    ) -> torch.Tensor:  # fmt: skip
        return self.model(input_ids, positions, ForwardContext(meta, self.kv_caches, states), embeds)

    def prepare(self, chunks: list[Chunk], prev: InFlight | None = None) -> StepInputs:
        """Pack the chunks into one varlen batch. A PENDING input token is read from ``prev``'s samples. With
        recurrent layers, their slots too, and the slots zeroed or restored for the step (done here)."""
        inputs = pack_step(chunks, self.block_size, self.device, prev, self.uploads, len(self.layout.groups))
        if self.images is not None:
            inputs = self.images.step_inputs(chunks, inputs, self.uploads, self.tp)
        elif self.image_width is not None:  # a worker: rank 0's rows and positions
            inputs = received_inputs(chunks, inputs, self.tp, self.image_width, self.uploads)
        if not self.layout.has_state:
            return inputs
        states = pack_states(chunks, self.device, self.uploads)
        init_states(self.kv_caches, states.zero, states.restore)
        return inputs._replace(states=states)

    def launch(self, chunks: list[Chunk], prev: InFlight | None = None, **options: bool) -> InFlight:
        """Queue the step on the device (inputs, model, sampling) without waiting for it; with workers,
        tell them first (a failure while they run it raises ``EngineDeadError``). ``options``: those of
        ``launch_local``."""
        if self.control is None:
            return self.launch_local(chunks, prev, **options)
        with self.control.step(chunks):
            return self.launch_local(chunks, prev, **options)

    @torch.inference_mode()
    def launch_local(
        self,
        chunks: list[Chunk],
        prev: InFlight | None = None,
        *,
        defer_sampling: bool = False,
        with_prompt_logprobs: bool = False,
    ) -> InFlight:
        """``launch`` on this rank alone: what a worker runs for each of rank 0's steps, and the warm-up.

        ``defer_sampling`` (rank 0): queue the model only; ``sample()`` queues the sampling later (once the
        constrained rows' grammar masks are known). The sampling parameters are read now either way.
        ``with_prompt_logprobs``: some request wants prompt logprobs (for its chunks; not with tensor parallelism)."""
        self.uploads.new_step()
        input_ids, positions, meta, sample_rows, states, embeds = self.prepare(chunks, prev)
        plain = embeds is None and positions.dim() == 1  # (no image rows: what the graphs take)
        if plain and self.graphs is not None and self.graphs.can_run(meta, states):
            hidden = self.graphs.run(input_ids, positions, meta, states)
            if states is not None:  # the snapshots of the step, which the graph does not take
                init_states(self.kv_caches, [], states.decode_copies())
        elif plain and self.prefill_graphs is not None and self.prefill_graphs.can_run(input_ids.shape[0]):
            hidden = self.prefill_graphs.run(input_ids, positions, ForwardContext(meta, self.kv_caches))
        else:
            hidden = self._forward(input_ids, positions, meta, states, embeds)
        prompt_logprobs = None
        if with_prompt_logprobs:
            prompt_logprobs = launch_prompt_logprobs(chunks, hidden, self.model.compute_logits, self.uploads)
        seqs = [c.seq for c in chunks if c.samples]
        if not seqs:
            return InFlight([], {}, None, prompt_logprobs=prompt_logprobs)
        if len(sample_rows) < hidden.shape[0]:
            hidden = hidden[to_device(sample_rows, torch.int64, self.device, self.uploads)]
        logits = self.model.compute_logits(hidden)  # [B, V], the model's dtype; None on ranks > 0
        rows = {s.request_id: i for i, s in enumerate(seqs)}
        if logits is None:  # a worker: rank 0 samples, and its samples come here for the next step's inputs
            token_ids = self.tp.broadcast(torch.empty(len(seqs), dtype=torch.int64, device=self.device))
            return InFlight(seqs, rows, SamplerOutput(token_ids, None, None, None))
        batch = make_sampling_batch(seqs, self.vocab_size, self.device, self.uploads)
        step = InFlight(seqs, rows, None, logits=logits, batch=batch, prompt_logprobs=prompt_logprobs)
        step.pooled = launch_pooling(seqs, hidden)  # embedding requests: their prompt's pooled hidden state
        if not defer_sampling:
            self._sample(step)
        return step

    def sample(self, step: InFlight, mask_rows: list[int] = (), bitmask: torch.Tensor | None = None) -> None:
        """Queue the sampling of a step launched with ``defer_sampling``; ``bitmask`` [len(mask_rows), W]
        int32 (host) holds the grammar masks of rows ``mask_rows``. With workers (who wait for the samples'
        broadcast) a failure is the engine's death."""
        if bitmask is not None:
            add_token_bitmask(step.batch, list(mask_rows), bitmask, self.device, self.uploads)
        if self.control is None:
            self._sample(step)
            return
        try:
            self._sample(step)
        except Exception as exc:
            raise self.control.dead(exc) from exc

    @torch.inference_mode()
    def _sample(self, step: InFlight) -> None:
        out = sample(step.logits, step.batch)
        if self.tp.size > 1:
            self.tp.broadcast(out.token_ids)
        step.out = step.host = out
        step.logits = step.batch = None
        if self.device.type == "cuda":
            # Start the copy back now and wait for this event alone in collect(): a plain .tolist() would
            # also wait for the step launched after this one, and nothing would overlap.
            fields = (getattr(out, f.name) for f in dataclasses.fields(out))  # (astuple would deep-copy them)
            step.host = SamplerOutput(*(None if t is None else copy_to_host(t) for t in fields))
            step.copied = torch.cuda.Event()
            step.copied.record()

    def collect(self, step: InFlight) -> dict[str, SampledToken]:
        """Wait for a launched step; its sampled token (and logprobs) per sequence that sampled."""
        for extra in (step.prompt_logprobs, step.pooled):  # (a host synchronisation of its own: only if asked)
            if extra is not None:
                extra.read()
        if step.host is None:
            return {}
        if step.copied is not None:
            start = time.perf_counter()
            step.copied.synchronize()  # the step's one host synchronisation
            self.device_wait_seconds += time.perf_counter() - start
        return read_samples(step.seqs, step.host)

    def execute(self, chunks: list[Chunk]) -> dict[str, SampledToken]:
        """Compute the chunks and wait for their samples (no token of theirs may be pending)."""
        return self.collect(self.launch(chunks))
