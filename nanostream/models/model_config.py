"""Reading a model directory's config.json: the one place that does, for the engine and the config reader.

``read_model_config(path)`` reads it with transformers, names the architecture it runs (refusing one it does not,
with the list of those it does) and gives the language model's config as ``ConfigFields``: a field the config
lacks raises ``MissingConfigField``, a ``ModelLoadError`` naming the architecture and the field, never a raw
``AttributeError`` from deep in the engine::

    model = read_model_config(Path("/models/Qwen3-0.6B"))
    model.architecture, model.text.max_position_embeddings   # 'Qwen3ForCausalLM', 40960
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanostream.errors import ModelLoadError
from nanostream.models.architectures import ARCHITECTURES, TEXT_MODELS, UNSUPPORTED_ARCHITECTURES, supported_list


class MissingConfigField(ModelLoadError, AttributeError):
    """A config lacks a field the architecture needs. An ``AttributeError`` too, so that
    ``getattr(fields, key, default)`` still gives the default for an optional field."""


class ConfigFields:
    """A transformers config read for ``architecture``: ``fields.hidden_size`` is the config's, or raises
    ``MissingConfigField`` naming the architecture and the field."""

    def __init__(self, config: Any, architecture: str) -> None:
        self._config, self._architecture = config, architecture

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # copy, pickle and the like ask for dunders: the config's answer is not theirs
            raise AttributeError(name)
        try:
            return getattr(self._config, name)
        except AttributeError:
            kind = type(self._config).__name__
            raise MissingConfigField(
                f"{self._architecture}'s config.json ({kind}) has no {name}, which nanostream needs to run it; "
                "is the checkpoint's config.json complete, and is its architectures entry right?"
            ) from None

    def __repr__(self) -> str:
        return f"ConfigFields({self._architecture}, {self._config!r})"


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    """The checkpoint's architecture, one nanostream runs (``Gemma3ForConditionalGeneration``)."""
    hf_config: Any
    """transformers' config as read (a multimodal checkpoint's whole config)."""
    text: ConfigFields
    """The config of the decoder nanostream runs: ``hf_config`` or a multimodal checkpoint's text config."""


def read_model_config(path: Path) -> ModelConfig:
    """``path``'s config.json, read and checked: its architecture is one nanostream runs (``ModelLoadError``
    otherwise, naming it and listing those it runs)."""
    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.from_pretrained(path)
    except Exception as exc:
        raise ModelLoadError(f"cannot read {path / 'config.json'}: {exc}") from exc
    architecture = supported_architecture(hf_config)
    return ModelConfig(architecture, hf_config, ConfigFields(text_config(hf_config), architecture))


def supported_architecture(hf_config: Any) -> str:
    """The first of the config's ``architectures`` nanostream runs, a decoder of its own or a multimodal
    checkpoint's language model; ``ModelLoadError`` listing those it runs if none is."""
    architectures = getattr(hf_config, "architectures", None) or []
    refused = next((a for a in architectures if a in UNSUPPORTED_ARCHITECTURES), None)
    if refused is not None:
        raise ModelLoadError(f"{refused} is not supported: {UNSUPPORTED_ARCHITECTURES[refused]}")
    name = next((a for a in architectures if a in ARCHITECTURES or a in TEXT_MODELS), None)
    if name is None:
        raise ModelLoadError(
            f"unsupported architecture {architectures or 'missing'} in config.json; nanostream runs {supported_list()}"
        )
    return name


def text_config(hf_config: Any) -> Any:
    """The config of the decoder nanostream runs: ``hf_config`` itself, or a multimodal checkpoint's text config
    (``TEXT_MODELS``) as its text model's architecture, with the checkpoint's quantization_config and
    tie_word_embeddings."""
    wrapper = supported_architecture(hf_config)
    if wrapper not in TEXT_MODELS:
        return hf_config
    if getattr(hf_config, "text_config", None) is None:
        raise MissingConfigField(f"{wrapper}'s config.json has no text_config, the language model's settings")
    text = copy.deepcopy(hf_config.text_config)
    text.architectures = [TEXT_MODELS[wrapper].language_model(text)]
    if getattr(hf_config, "tie_word_embeddings", None) is not None:  # transformers ties by the wrapper's config
        text.tie_word_embeddings = hf_config.tie_word_embeddings
    quant = getattr(hf_config, "quantization_config", None)
    if quant is not None:
        text.quantization_config = quant
    return text
