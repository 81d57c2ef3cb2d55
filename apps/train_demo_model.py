"""Train nanostream's demo model: a small Qwen3 trained from scratch on public-domain English text.

Corpus, tokenizer and training data: apps/demo_corpus.py, which says what the corpus holds, where it
comes from and how to rebuild it (``--build-corpus ROOT --corpus FILE``). The corpus built on
2026-11-29 has sha256 f0d56e78f7d59cf74b342688a1657c2d1c3c04e5030db3efd378e41cd07b13d0.

Train (the shipped model: the defaults are its settings; one H200; --time-limit stops the training
after 7 minutes at the latest and anneals the learning rate by then, so the command ends within 10)::

    python apps/train_demo_model.py --corpus .gpu/corpus/corpus.txt --out OUT_DIR --time-limit 420

The shipped model (nanostream/demo-model/, its training_log.json) came from this with ``--steps 1000
--time-limit 330`` on an H200, 2026-11-29: 1,000 steps (19 epochs) in 117 s while two other runs
shared the GPU, validation loss 3.656 at the last step. Runs of 2,000 and 3,000 steps with the same
seed overfit: their best validation losses were 3.744 and 3.759, both at step 800, so 1,000 is
the default.

What it does: trains a byte-level BPE tokenizer on the corpus (``tokenizers``; the special tokens
and ChatML chat template of ``nanostream.testing``), wraps a seeded fraction of the documents as
one chat turn ("Read me Genesis chapter 1." / "Tell me a fortune." -> the document) so the chat
frontends get answers that end with ``<|im_end|>``, holds out 2% of the documents for validation,
and trains ``Qwen3ForCausalLM(Qwen3Config(...))`` with AdamW and a warm-up + cosine schedule (bf16
autocast on CUDA), with dropout on each residual branch (forward hooks used only while training,
so the architecture stays plain Qwen3). It keeps the weights of the best validation loss, saves them
in bfloat16 with ``save_pretrained`` (config.json, model.safetensors, generation_config.json) plus
the tokenizer, then prints samples and writes everything it printed to ``OUT_DIR/training_log.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import platform
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from demo_corpus import build_corpus, encode_documents, read_documents, split_documents, train_tokenizer

# 12.5M parameters (the tied embedding counted once) are 25.0e6 bytes in bfloat16; the limit in
# bytes leaves room for the safetensors header.
MAX_PARAMS = 12_500_000
MAX_CHECKPOINT_BYTES = 25 * 2**20


@dataclass(frozen=True)
class TrainConfig:
    """Every option of the script; the defaults are the shipped model's settings and feed argparse."""

    corpus: str = field(default="", metadata={"help": "corpus text file (documents separated by a blank line)"})
    out: str = field(default="", metadata={"help": "output model directory"})
    build_corpus: str = field(default="", metadata={"help": "unpacked .deb root: write --corpus from it and exit"})
    seed: int = field(default=0, metadata={"help": "seed for the split, chat wrapping, init and batches"})
    steps: int = field(default=1000, metadata={"help": "optimizer steps"})
    batch_size: int = field(default=32, metadata={"help": "sequences per step"})
    seq_len: int = field(default=1024, metadata={"help": "tokens per sequence (also max_position_embeddings)"})
    lr: float = field(default=2e-3, metadata={"help": "peak learning rate"})
    min_lr_ratio: float = field(default=0.1, metadata={"help": "final learning rate as a fraction of --lr"})
    warmup: int = field(default=100, metadata={"help": "linear warm-up steps"})
    weight_decay: float = field(default=0.1, metadata={"help": "AdamW weight decay (matrices only)"})
    dropout: float = field(default=0.2, metadata={"help": "dropout on each residual branch while training"})
    grad_clip: float = field(default=1.0, metadata={"help": "gradient-norm clip"})
    vocab_size: int = field(default=6000, metadata={"help": "BPE vocabulary size, special tokens included"})
    hidden_size: int = field(default=384, metadata={"help": "model width"})
    num_layers: int = field(default=6, metadata={"help": "decoder layers"})
    num_heads: int = field(default=6, metadata={"help": "query heads"})
    num_kv_heads: int = field(default=2, metadata={"help": "key/value heads"})
    head_dim: int = field(default=64, metadata={"help": "per-head dimension"})
    intermediate_size: int = field(default=1024, metadata={"help": "MLP width"})
    chat_fraction: float = field(default=0.25, metadata={"help": "fraction of documents wrapped as a chat turn"})
    val_fraction: float = field(default=0.02, metadata={"help": "fraction of documents held out"})
    device: str = field(default="", metadata={"help": "torch device (default: cuda when available, else cpu)"})
    time_limit: float = field(default=0.0, metadata={"help": "seconds of training before stopping (0: none)"})
    eval_every: int = field(default=200, metadata={"help": "steps between validation evaluations"})
    log_every: int = field(default=50, metadata={"help": "steps between printed training losses"})
    compile: bool = field(default=False, metadata={"help": "torch.compile the model for training"})
    sample_tokens: int = field(default=64, metadata={"help": "new tokens per printed sample"})


def parse_args(argv: list[str] | None) -> TrainConfig:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type == "bool":
            parser.add_argument(flag, action="store_true", help=f.metadata["help"])
        else:
            kind = {"int": int, "float": float, "str": str}[f.type]
            parser.add_argument(flag, type=kind, default=f.default, help=f"{f.metadata['help']} ({f.default})")
    cfg = TrainConfig(**vars(parser.parse_args(argv)))
    if not cfg.corpus:
        parser.error("--corpus is required")
    if not cfg.build_corpus and not cfg.out:
        parser.error("--out is required to train")
    return cfg


# ---- model and training ---------------------------------------------------------------------------


def build_model(cfg: TrainConfig, tokenizer):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.seq_len,
        tie_word_embeddings=True,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
    )
    model = Qwen3ForCausalLM(config)
    num_params = sum(p.numel() for p in model.parameters())  # the tied embedding is one parameter
    if num_params > MAX_PARAMS:
        raise ValueError(
            f"the model has {num_params / 1e6:.2f}M parameters, over the {MAX_PARAMS / 1e6}M that keep the "
            "bfloat16 checkpoint within 25 MB; lower --hidden-size, --num-layers, --intermediate-size or --vocab-size"
        )
    return model, num_params


def add_residual_dropout(model, p: float) -> None:
    """Dropout on the output of every attention and MLP block, only in training mode."""

    def hook(module, args, output):
        if not module.training or p == 0:
            return output
        if isinstance(output, tuple):  # attention returns (output, weights)
            return (F.dropout(output[0], p, True), *output[1:])
        return F.dropout(output, p, True)

    for layer in model.model.layers:
        layer.self_attn.register_forward_hook(hook)
        layer.mlp.register_forward_hook(hook)


def lr_at(step: int, progress: float, cfg: TrainConfig) -> float:
    """Linear warm-up over ``cfg.warmup`` steps, then cosine from lr to lr * min_lr_ratio as progress 0 -> 1."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def lm_loss(model, tokens: torch.Tensor, autocast: bool) -> torch.Tensor:
    # tokens: [B, T+1]; predict tokens[:, 1:] from tokens[:, :-1]
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=tokens[:, :-1]).logits  # [B, T, V]
    return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


@torch.no_grad()
def evaluate(model, val_windows: torch.Tensor, batch_size: int, autocast: bool) -> float:
    model.eval()
    total = 0.0
    for i in range(0, len(val_windows), batch_size):
        batch = val_windows[i : i + batch_size]
        total += lm_loss(model, batch, autocast).item() * len(batch)
    model.train()
    return total / len(val_windows)


def _evaluate_and_keep(step_model, model, step, val_windows, batch_size, autocast, evals, best):
    val = evaluate(step_model, val_windows, batch_size, autocast)
    evals.append({"step": step, "val_loss": val})
    print(f"step {step:5d} | val loss {val:.4f}", flush=True)
    if val < best[0]:
        best = (val, step, {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()})
    return best


def train(cfg: TrainConfig, model, train_ids: torch.Tensor, val_windows: torch.Tensor, device: str) -> dict[str, Any]:
    """Train in place; load the best-validation weights back at the end. Returns the loss curve."""
    autocast = device.startswith("cuda")
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.95),
        fused=autocast,
    )
    step_model = torch.compile(model) if cfg.compile else model
    # Batch offsets are drawn on the device: a host-to-device copy of them each step would wait for the
    # GPU's queue to drain and leave it idle while Python launches the next step.
    batches = torch.Generator(device=device).manual_seed(cfg.seed)
    offsets = torch.arange(cfg.seq_len + 1, device=device)
    curve: list[dict[str, float]] = []
    evals: list[dict[str, float]] = []
    best: tuple[float, int, dict | None] = (math.inf, -1, None)  # (val loss, step, CPU weights)
    model.train()
    start = interval_start = time.perf_counter()
    loss_sum, interval_steps, step = torch.zeros((), device=device), 0, 0
    while step < cfg.steps:
        elapsed = time.perf_counter() - start
        if cfg.time_limit and elapsed > cfg.time_limit:
            print(f"time limit of {cfg.time_limit:.0f}s reached after {step} steps", flush=True)
            break
        # With a time limit the cosine follows whichever ends first, steps or time, so the rate is
        # annealed when the clock stops the run.
        progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
        if cfg.time_limit:
            progress = max(progress, elapsed / cfg.time_limit)
        lr = lr_at(step, progress, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, len(train_ids) - cfg.seq_len - 1, (cfg.batch_size,), generator=batches, device=device)
        tokens = train_ids[starts[:, None] + offsets]  # [B, T+1]
        loss = lm_loss(step_model, tokens, autocast)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        step += 1
        loss_sum += loss.detach()
        interval_steps += 1
        if step % cfg.log_every == 0 or step == cfg.steps:
            mean = loss_sum.item() / interval_steps  # .item() waits for the GPU: the interval is timed
            now = time.perf_counter()
            tok_s = interval_steps * cfg.batch_size * cfg.seq_len / (now - interval_start)
            curve.append({"step": step, "train_loss": mean, "lr": lr, "tokens_per_s": tok_s, "time_s": now - start})
            print(f"step {step:5d} | loss {mean:.4f} | lr {lr:.2e} | {tok_s:9.0f} tok/s | {now - start:6.1f}s")
            loss_sum.zero_()
            interval_steps, interval_start = 0, time.perf_counter()
        if step % cfg.eval_every == 0 or step == cfg.steps:
            best = _evaluate_and_keep(step_model, model, step, val_windows, cfg.batch_size, autocast, evals, best)
            interval_start = time.perf_counter()  # the evaluation is not training time
    if not evals or evals[-1]["step"] != step:
        best = _evaluate_and_keep(step_model, model, step, val_windows, cfg.batch_size, autocast, evals, best)
    if best[1] != step:
        print(f"keeping the weights of step {best[1]} (val loss {best[0]:.4f})", flush=True)
        model.load_state_dict(best[2])
    return {
        "train_curve": curve,
        "val_curve": evals,
        "steps_done": step,
        "best_step": best[1],
        "best_val_loss": best[0],
        "train_time_s": time.perf_counter() - start,
    }


# ---- saving and samples ---------------------------------------------------------------------------


def save(model, tokenizer, out: Path) -> None:
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    tokenizer.model_max_length = model.config.max_position_embeddings
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    ids = tokenizer.convert_tokens_to_ids
    # Greedy by default (no sampling settings); a chat reply ends at <|im_end|>, plain text at <|endoftext|>.
    GenerationConfig(
        bos_token_id=ids("<|endoftext|>"),
        pad_token_id=ids("<|endoftext|>"),
        eos_token_id=[ids("<|endoftext|>"), ids("<|im_end|>")],
    ).save_pretrained(out)
    size = (out / "model.safetensors").stat().st_size
    assert size <= MAX_CHECKPOINT_BYTES, f"model.safetensors is {size} bytes"  # follows from MAX_PARAMS


def samples(out: Path, device: str, seed: int, max_new_tokens: int) -> list[dict[str, Any]]:
    """Generations from the saved directory (the shipped bfloat16 weights, run in float32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).to(device).eval()

    def chat(text: str) -> str:
        messages = [{"role": "user", "content": text}]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    cases = [
        ("In the beginning", False),
        ("The meaning of life is", True),
        (chat("Tell me a fortune."), True),
        (chat("Read me Psalms chapter 23."), False),
    ]
    results = []
    torch.manual_seed(seed)
    for prompt, sample in cases:
        ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"].to(device)
        kwargs = {"do_sample": True, "temperature": 0.8, "top_k": 50} if sample else {"do_sample": False}
        with torch.no_grad():
            out_ids = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, **kwargs)
        text = tokenizer.decode(out_ids[0, ids.shape[1] :], skip_special_tokens=False)
        results.append({"prompt": prompt, "mode": "sampled t=0.8 top_k=50" if sample else "greedy", "text": text})
        print(f"--- {results[-1]['mode']}: {prompt!r}\n{text}", flush=True)
    return results


# ---- main -----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict[str, Any]:
    cfg = parse_args(argv)
    if cfg.build_corpus:
        text = build_corpus(Path(cfg.build_corpus))
        Path(cfg.corpus).write_text(text, encoding="utf-8")
        print(f"wrote {cfg.corpus}: {len(text):,} characters, {len(text.encode()) / 1e6:.2f} MB")
        return {"corpus_chars": len(text)}

    device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(cfg.seed)
    torch.set_float32_matmul_precision("high")
    corpus = Path(cfg.corpus)
    docs = read_documents(corpus)
    t0 = time.perf_counter()
    tokenizer = train_tokenizer(docs, cfg.vocab_size)
    rng = random.Random(cfg.seed)
    encoded = encode_documents(tokenizer, docs, rng, cfg.chat_fraction)
    train_idx, val_idx = split_documents(len(docs), cfg.val_fraction, rng)
    train_ids = torch.tensor([t for i in train_idx for t in encoded[i]], dtype=torch.long, device=device)
    val_ids = torch.tensor([t for i in val_idx for t in encoded[i]], dtype=torch.long, device=device)
    window = min(cfg.seq_len, len(val_ids) - 1)
    val_windows = val_ids[: (len(val_ids) - 1) // window * window + 1].unfold(0, window + 1, window)  # [N, w+1]
    if len(train_ids) <= cfg.seq_len + 1:
        raise ValueError(f"the training split has {len(train_ids)} tokens; use a larger corpus or a smaller --seq-len")
    print(
        f"corpus {corpus}: {len(docs):,} documents, {sum(map(len, docs)):,} characters; vocabulary {len(tokenizer)}; "
        f"{len(train_ids):,} train / {len(val_ids):,} validation tokens ({time.perf_counter() - t0:.1f}s)",
        flush=True,
    )

    model, num_params = build_model(cfg, tokenizer)
    add_residual_dropout(model, cfg.dropout)
    model.to(device)
    print(f"Qwen3: {num_params / 1e6:.2f}M parameters ({2 * num_params / 2**20:.1f} MiB in bfloat16) on {device}")
    tokens_per_step = cfg.batch_size * cfg.seq_len
    epochs = cfg.steps * tokens_per_step / len(train_ids)
    print(f"{tokens_per_step:,} tokens per step; {cfg.steps} steps = {epochs:.1f} epochs of the training split")
    result = train(cfg, model, train_ids, val_windows, device)

    out = Path(cfg.out)
    save(model, tokenizer, out)
    sample_texts = samples(out, device, cfg.seed, cfg.sample_tokens)
    final_val = result["best_val_loss"]  # the saved weights are the best-validation ones
    print(f"final validation loss {final_val:.4f} (weights of step {result['best_step']})")
    log = {
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "config": dataclasses.asdict(cfg),
        "corpus_sha256": hashlib.sha256(corpus.read_bytes()).hexdigest(),
        "corpus_documents": len(docs),
        "corpus_chars": sum(map(len, docs)),
        "vocab_size": len(tokenizer),
        "train_tokens": len(train_ids),
        "val_tokens": len(val_ids),
        "num_params": num_params,
        "checkpoint_bytes": (out / "model.safetensors").stat().st_size,
        "final_val_loss": final_val,
        **result,
        "samples": sample_texts,
        "device": torch.cuda.get_device_name() if device.startswith("cuda") else platform.processor() or "cpu",
        "versions": {"python": platform.python_version(), "torch": torch.__version__, **_lib_versions()},
    }
    (out / "training_log.json").write_text(json.dumps(log, indent=2) + "\n")
    return log


def _lib_versions() -> dict[str, str]:
    import tokenizers
    import transformers

    return {"transformers": transformers.__version__, "tokenizers": tokenizers.__version__}


if __name__ == "__main__":
    main()
