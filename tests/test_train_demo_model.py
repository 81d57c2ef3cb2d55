"""apps/train_demo_model.py end to end on CPU: a tiny model trained for a few steps loads in nanostream
and in transformers, decodes the same greedy tokens in both, and stays within the checkpoint bound."""

import json
import math
from pathlib import Path

import pytest
import torch

from nanostream import LLM, SamplingParams

SCRIPT = Path(__file__).resolve().parents[1] / "apps" / "train_demo_model.py"
TINY = [
    "--vocab-size", "400", "--hidden-size", "64", "--num-layers", "2", "--num-heads", "4", "--num-kv-heads", "2",
    "--head-dim", "16", "--intermediate-size", "128", "--seq-len", "64", "--batch-size", "8", "--steps", "20",
    "--lr", "1e-2", "--warmup", "4", "--log-every", "5", "--eval-every", "10", "--sample-tokens", "8",
    "--device", "cpu", "--seed", "3",
]  # fmt: skip


@pytest.fixture(scope="module")
def script(load_app):
    return load_app("train_demo_model")


@pytest.fixture(scope="module")
def corpus(load_app):
    return load_app("demo_corpus")


def synthetic_corpus() -> str:
    verses = [
        "In the beginning the lamp was lit, and the keeper wrote to the sea.",
        "And the sea answered not, but the sand held new shapes every morning.",
        "And the miller counted his sacks of grain by the light of the lamp.",
    ]
    docs = [f"Genesis {i}\n" + "\n".join(verses[i % 3 :] + verses[: i % 3]) for i in range(1, 25)]
    docs += [
        f"Fortune {i}: the river runs past the old mill; seven boats wait for the tide.\n-- Anon" for i in range(40)
    ]
    return "\n\n".join(docs) + "\n"


@pytest.fixture(scope="module")
def trained(script, tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    corpus = root / "corpus.txt"
    corpus.write_text(synthetic_corpus())
    out = root / "model"
    log = script.main(["--corpus", str(corpus), "--out", str(out), *TINY])
    return out, log


def test_loss_goes_down_and_log_is_written(trained):
    out, log = trained
    curve = [p["train_loss"] for p in log["train_curve"]]
    assert len(curve) == 4 and log["steps_done"] == 20
    assert curve[-1] < curve[0] - 1.0, curve
    assert log["final_val_loss"] < math.log(log["vocab_size"]) - 1.0
    assert [e["step"] for e in log["val_curve"]] == [10, 20]
    on_disk = json.loads((out / "training_log.json").read_text())
    assert on_disk["final_val_loss"] == log["final_val_loss"]
    assert len(on_disk["samples"]) == 4 and all(isinstance(s["text"], str) for s in on_disk["samples"])


def test_checkpoint_within_bound(script, trained):
    out, log = trained
    size = (out / "model.safetensors").stat().st_size
    assert size == log["checkpoint_bytes"] <= script.MAX_CHECKPOINT_BYTES
    assert 2 * log["num_params"] < size < 2 * log["num_params"] + 64 * 1024  # bfloat16 plus the header
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_default_size_fits_and_a_larger_one_is_refused(script):
    class Vocab:  # a tokenizer's size and special ids are all build_model reads
        def __init__(self, n):
            self.n = n

        def __len__(self):
            return self.n

        def convert_tokens_to_ids(self, token):
            return 0

    defaults = script.TrainConfig()
    with torch.device("meta"):
        _, num_params = script.build_model(defaults, Vocab(defaults.vocab_size))
        assert 10_000_000 < num_params <= script.MAX_PARAMS
        bigger = script.TrainConfig(num_layers=defaults.num_layers + 2)
        with pytest.raises(ValueError, match="over the 12.5M"):
            script.build_model(bigger, Vocab(defaults.vocab_size))


def test_nanostream_greedy_matches_transformers(trained):
    from transformers import AutoModelForCausalLM

    out, _ = trained
    llm = LLM(str(out), device="cpu", kvcache_block_size=16)
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    im_end, eot = llm.tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert llm.engine.eos_token_ids == {im_end, eot}  # chat replies stop at <|im_end|>
    prompt = llm.tokenizer("And the miller counted", add_special_tokens=False).input_ids
    ours = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=20,
            min_new_tokens=20,
            do_sample=False,
        )
    assert ours[0].token_ids == ref[0, len(prompt) :].tolist()


def test_tokenizer_round_trips_and_has_the_chat_template(trained):
    from transformers import AutoTokenizer

    out, _ = trained
    tok = AutoTokenizer.from_pretrained(out)
    text = "The keeper wrote: «naïve» 🙂 déjà-vu\n  two spaces"
    assert tok.decode(tok(text, add_special_tokens=False).input_ids) == text
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        assert len(tok(special, add_special_tokens=False).input_ids) == 1
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|endoftext|>" and len(tok) == 400


def test_tokenizer_training_is_deterministic(corpus):
    docs = synthetic_corpus().split("\n\n")
    first, second = (corpus.train_tokenizer(docs, 350) for _ in range(2))
    assert first.get_vocab() == second.get_vocab()
    assert first.backend_tokenizer.to_str() == second.backend_tokenizer.to_str()


def test_corpus_normalization(corpus):
    mojibake = "\u00c3\u00a2\u00c2\u0080\u00c2\u0099"  # U+2019 encoded in UTF-8, read as Latin-1 twice
    fortunes = f"Calm down, it's *____\b\b\b\bonly* ones.\n\t\t-- Anon\n%\nHere{mojibake}s B\bBOLD\n\n%\n"
    assert corpus.fortune_entries(fortunes) == ["Calm down, it's *only* ones.\n-- Anon", "Here's BOLD"]
    abbrevs = ["Ge", "Exo", "1Sm"] + [f"X{chr(65 + i // 26)}{chr(65 + i % 26)}" for i in range(63)]
    dump = "\n".join(f"{a}1:{v} Verse {v} of {a}." for a in abbrevs for v in (1, 2)) + "\n"
    docs = corpus.kjv_documents(dump)
    assert docs[0] == "Genesis 1\nVerse 1 of Ge.\nVerse 2 of Ge." and docs[2].startswith("Leviticus 1\nVerse 1 of 1Sm.")
    assert len(docs) == 66 and docs[-1].startswith("Revelation 1\n")
    with pytest.raises(ValueError, match="66"):
        corpus.kjv_documents(dump.split("Exo1:1")[0])
