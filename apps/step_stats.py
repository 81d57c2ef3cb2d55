"""What the engine's steps cost in apps/bench.py's timed run (``--step-stats``): wall time by kind of
step, each group against its floor (the bytes it must read at the device's copy bandwidth), and the
other causes of a slow step (the collector's pauses, the CUDA allocator's retries, late Triton compiles).
"""

from __future__ import annotations

import gc
import time

import torch
from tables import format_table

from nanostream import LLM


class StepStats:
    """Wall time of every engine step of the timed run, by kind: steps that compute prompt tokens, and
    decode-only steps by batch size. With the pipelined step, a step's wall time is the longer of its
    host work and the device's work on the step before it."""

    def __init__(self, llm: LLM) -> None:
        self.steps: list[tuple[float, int, int]] = []  # (seconds, prefill tokens, decode tokens)
        self.contexts: list[list[int]] = []  # per step: the tokens each running sequence holds (the KV it reads)
        self.floor = StepFloor(llm) if llm.config.device.startswith("cuda") else None
        step, running = llm.engine.step, llm.engine.scheduler.running

        def timed_step():
            start = time.perf_counter()
            result = step()
            self.steps.append((time.perf_counter() - start, result.num_prefill_tokens, result.num_decode_tokens))
            self.contexts.append([seq.num_tokens for seq in running])
            return result

        llm.engine.step = timed_step
        # Other causes of a slow step: the collector's pauses, and the CUDA allocator freeing its cache
        # to retry an allocation (a device sync and cudaFree calls).
        self.pauses: list[tuple[int, int, float]] = []  # (step, generation, seconds) of collections over 5 ms
        self._gc_start = 0.0

        def collected(phase: str, info: dict) -> None:
            if phase == "start":
                self._gc_start = time.perf_counter()
            elif (seconds := time.perf_counter() - self._gc_start) > 5e-3:
                self.pauses.append((len(self.steps), info["generation"], seconds))

        self._gc_callback = collected
        gc.callbacks.append(collected)
        self._cuda = llm.config.device.startswith("cuda")
        self._retries = torch.cuda.memory_stats().get("num_alloc_retries", 0) if self._cuda else 0
        # Triton kernels compiled inside the timed run (variants the warm-up did not reach), by step.
        self.compiles: list[tuple[int, str]] = []
        try:
            from triton import knobs
        except ImportError:
            return
        self._knobs = knobs

        def compiled(*, repr: str, **_: object) -> None:
            self.compiles.append((len(self.steps), repr))

        knobs.runtime.jit_post_compile_hook = compiled

    def close(self) -> None:
        gc.callbacks.remove(self._gc_callback)
        if self._cuda:
            self._retries = torch.cuda.memory_stats().get("num_alloc_retries", 0) - self._retries
        if hasattr(self, "_knobs"):
            self._knobs.runtime.jit_post_compile_hook = None

    @staticmethod
    def group(prefill: int, decode: int) -> int:
        """-1 for a step with prompt tokens, else its decode batch rounded down to a power of two."""
        return -1 if prefill else 1 << max(0, decode.bit_length() - 1)

    @staticmethod
    def label(group: int) -> str:
        return "with prefill" if group < 0 else f"decode {group}-{2 * group - 1}" if group > 1 else "decode 1"

    def table(self, factor: float = 3.0, limit: int = 10) -> str:
        """Steps by group, then the steps over ``factor`` times their group's median (first-use costs)."""
        groups: dict[int, list[float]] = {}
        for seconds, prefill, decode in self.steps:
            groups.setdefault(self.group(prefill, decode), []).append(seconds)
        medians = {g: sorted(times)[len(times) // 2] for g, times in groups.items()}
        floors: dict[int, float] = {}  # s: the steps' floors, summed by group
        if self.floor is not None:
            for (_, prefill, decode), context in zip(self.steps, self.contexts):
                g = self.group(prefill, decode)
                floors[g] = floors.get(g, 0.0) + self.floor.seconds(prefill + decode, context)
        total = sum(s for s, _, _ in self.steps)
        rows = [("steps", "count", "total s", "share", "mean ms", "median ms", "floor s", "floor / time")]
        for g in sorted(groups, key=lambda g: (g >= 0, -g)):  # prefill first, then falling batch size
            times = groups[g]
            floor = (f"{floors[g]:.2f}", f"{floors[g] / sum(times):.2f}") if g in floors else ("", "")
            rows.append((self.label(g), str(len(times)), f"{sum(times):.2f}", f"{sum(times) / total:.0%}",
                         f"{1e3 * sum(times) / len(times):.2f}", f"{1e3 * medians[g]:.2f}", *floor))  # fmt: skip
        floor = (f"{sum(floors.values()):.2f}", f"{sum(floors.values()) / total:.2f}") if floors else ("", "")
        rows.append(("all", str(len(self.steps)), f"{total:.2f}", "100%", "", "", *floor))
        slow = [
            f"  step {i}: {1e3 * seconds:.1f} ms ({prefill} prefill + {decode} decode tokens)"
            for i, (seconds, prefill, decode) in enumerate(self.steps)
            if seconds > factor * medians[self.group(prefill, decode)]
        ]
        if slow:
            more = f" (the first {limit} of {len(slow)})" if len(slow) > limit else ""
            slow = [f"steps over {factor:g}x their group's median{more}:", *slow[:limit]]
        if self.pauses:
            slow.append(f"collector pauses over 5 ms ({len(self.pauses)}):")
            slow += [f"  step {i}: generation {g}, {1e3 * t:.1f} ms" for i, g, t in self.pauses[:limit]]
        if self._cuda:
            slow.append(f"CUDA allocator retries (cache freed to retry an allocation): {self._retries}")
        compiles = [f"  step {i}: {what[:240]}" for i, what in self.compiles]
        if compiles:
            compiles.insert(0, f"Triton kernels compiled during the timed run ({len(compiles)}):")
        notes = [self.floor.describe()] if self.floor is not None else []
        return "\n".join([*format_table(rows), *notes, *slow, *compiles[: limit + 1]])


class StepFloor:
    """A step's floor: the time to read, once, at the device's measured copy bandwidth, the weights it
    touches and the KV of its running sequences (of a sliding-window layer, at most the window of each),
    and to read and write back each running sequence's recurrent state (Gated DeltaNet, short convolutions).
    Weights: all but an untied embedding (a step reads a
    row of it per token), and of a mixture-of-experts layer only the experts its tokens can route to:
    E (1 - (1 - K/E)^T) of E for T tokens, as if each picked K experts uniformly. A prefill step is also
    bound by its arithmetic, which this does not count: its floor is the lowest."""

    def __init__(self, llm: LLM) -> None:
        from kernel_bench.peaks import copy_bandwidth

        from nanostream.layers.moe import SparseMoE

        runner = llm.engine.runner
        model = runner.model
        # (top_k, that layer's experts): their weights are read as far as tokens route to them
        self.experts = [(m.gate.top_k, m.experts) for m in model.modules() if isinstance(m, SparseMoE)]
        expert_params = {id(p) for _, m in self.experts for p in m.parameters()}
        self.dense = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in expert_params)
        embed = model.model.embed_tokens.weight
        if embed is not model.lm_head.weight:
            self.dense -= embed.numel() * embed.element_size()
        self.kv_per_token = runner.kv_block_bytes / runner.block_size  # K and V of every layer
        # a sliding layer reads at most its window of a sequence's context: (window, its share of the KV)
        windows = [w for w in runner.spec.layer_windows if w is not None]
        self.window_share = [(w, 1 / runner.spec.num_layers) for w in windows]
        self.state_bytes = runner.state_slot_bytes  # a sequence's state in every recurrent layer (0: none)
        self.bandwidth = copy_bandwidth()  # bytes/s, read + written

    def seconds(self, tokens: int, contexts: list[int]) -> float:
        """``tokens`` of the step; ``contexts``: each running sequence's tokens."""
        read = sum(contexts) * (1 - sum(share for _, share in self.window_share))
        read += sum(share * min(c, w) for w, share in self.window_share for c in contexts)
        nbytes = self.dense + read * self.kv_per_token + 2 * self.state_bytes * len(contexts)
        for k, m in self.experts:
            e = m.w13.shape[0]
            touched = e * (1 - (1 - k / e) ** tokens)
            nbytes += touched / e * (m.w13.numel() * m.w13.element_size() + m.w2.numel() * m.w2.element_size())
        return nbytes / self.bandwidth

    def describe(self) -> str:
        experts = sum(
            m.w13.numel() * m.w13.element_size() + m.w2.numel() * m.w2.element_size() for _, m in self.experts
        )
        state = f"a recurrent state of {self.state_bytes / 2**20:.1f} MiB a sequence read and written, "
        return (
            f"floor: weights {self.dense / 1e9:.2f} GB dense + {experts / 1e9:.2f} GB of experts (the touched share), "
            f"KV {self.kv_per_token / 1024:.0f} KiB a context token (a sliding layer's share within its window), "
            f"{state if self.state_bytes else ''}at {self.bandwidth / 1e12:.2f} TB/s"
        )
