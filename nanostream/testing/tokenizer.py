"""The tests' and demos' tokenizer: a byte-level BPE (transformers' fast tokenizer) trained on an embedded text,
with nanostream's special tokens and a ChatML chat template; built the same way on any machine, no download.
"""

from __future__ import annotations

from collections.abc import Iterable

# Byte-level BPE merges are learned from this text (written for nanostream). Emoji and CJK stay
# split over several byte tokens, which is what streaming detokenization must cope with.
CORPUS = """\
The engine keeps a pool of key and value blocks. Each request owns a table of blocks, and every
step the scheduler decides which requests run: decodes first, then pieces of long prompts, then
new arrivals while room remains. When memory runs out, the newest request steps aside and is
recomputed later from the prefix cache. Tokens stream to every client as soon as they exist.
A stream can end because the model said it was done, because it reached its length, or because
someone stopped listening. The river ran past the old mill, and the miller counted his sacks of
grain by the light of a lamp. Seven small boats waited at the pier for the morning tide.
Once upon a time there was a lighthouse keeper who wrote letters to the sea. The sea never wrote
back, but every morning the sand held new shapes, and the keeper read them as answers.
"""
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{%- macro text(c) %}{%- if c is string %}{{- c }}{%- elif c is iterable and c is not mapping %}"
    "{%- for p in c %}{%- if p.type in ('image', 'image_url') %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif p.type == 'text' %}{{- p.text }}{%- endif %}{%- endfor %}{%- endif %}{%- endmacro %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\n' }}"
    "{%- if messages and messages[0].role == 'system' %}{{- text(messages[0].content) + '\n\n' }}{%- endif %}"
    "{{- '# Tools\n\nYou can call these functions, each described in JSON inside <tools></tools>:\n<tools>' }}"
    "{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\n</tools>\n\nTo call one, answer with its name and JSON arguments inside <tool_call></tool_call>:\n"
    '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n\' }}'
    "{%- elif messages and messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\n' + text(messages[0].content) + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + m.role + '\n' + text(m.content) + '<|im_end|>\n' }}"
    "{%- elif m.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\n' }}"
    "{%- if m.reasoning_content is string and m.reasoning_content and loop.index0 > ns.last_user %}"
    "{{- '<think>\n' + m.reasoning_content.strip() + '\n</think>\n\n' }}"
    "{%- endif %}"
    "{{- text(m.content) }}"
    "{%- for call in m.tool_calls or [] %}"
    "{%- set f = call.function if call.function is defined else call %}"
    "{%- if not loop.first or text(m.content) %}{{- '\n' }}{%- endif %}"
    '{{- \'<tool_call>\n{"name": "\' + f.name + \'", "arguments": \' }}'
    "{{- f.arguments if f.arguments is string else f.arguments | tojson }}"
    "{{- '}\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\n<tool_response>\n' + text(m.content) + '\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}"
    "{%- endif %}"
)
"""A Qwen3-style ChatML template (nanostream's own wording): a message's content a string or a list of text and
image parts (an image as Qwen's ``<|vision_start|><|image_pad|><|vision_end|>``), tools in the system turn, tool
calls as ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``, tool results as ``<tool_response>`` in a
user turn, an assistant's recent ``reasoning_content`` as ``<think>``, and ``enable_thinking=False``
closing an empty ``<think>`` block at the start of the reply. Plain conversations render as ChatML."""


def build_tokenizer(vocab_size: int = 512, texts: Iterable[str] | None = None, *, nfc: bool = False):
    """A byte-level BPE tokenizer (transformers' fast tokenizer) with nanostream's special tokens and
    ChatML chat template, trained on ``texts`` (default: the embedded text). ``nfc``: NFC-normalise
    the input first. The BPE trainer is deterministic for a given input order."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines() if texts is None else texts, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>", clean_up_tokenization_spaces=False
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast
