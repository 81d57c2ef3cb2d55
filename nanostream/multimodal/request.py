"""A prompt's images as the engine takes them (``protocol.ImageInput``), from the client's sources: the one path of
``LLM``, ``AsyncClient`` and the servers.

    template_messages, sources = split_image_parts(messages)
    ids = render_chat(tokenizer, template_messages, ...)          # one image token per image part
    ids, images = prompt_images(ids, sources, preparer, policy)   # placeholders widened, images prepared
"""

from __future__ import annotations

from collections.abc import Sequence

from nanostream.multimodal.policy import ImageError, ImagePolicy
from nanostream.multimodal.processor import ImagePreparer
from nanostream.multimodal.sources import ImageSource, load_images
from nanostream.protocol import ImageInput

NO_IMAGES = "this model takes no images (it runs text only); send the message as text"


def prompt_images(
    ids: list[int],
    sources: Sequence[ImageSource],
    preparer: ImagePreparer | None,
    policy: ImagePolicy,
    refusal: str = NO_IMAGES,
) -> tuple[list[int], list[ImageInput]]:
    """``ids`` with each image's placeholder widened to its tokens, and the images as the engine takes them (none:
    ``ids`` unchanged). ``ImageError`` (an ``InvalidRequestError``) for an image that cannot be had or read, or a
    model without images (``preparer`` None: ``refusal`` says why)."""
    if not sources:
        return ids, []
    if preparer is None:
        raise ImageError(refusal)
    prepared = [preparer.prepare(image) for image in load_images(list(sources), policy)]
    ids, offsets = preparer.place(ids, prepared)
    return ids, [ImageInput(o, i.grid, i.pixels.astype("<f4", copy=False).tobytes()) for o, i in zip(offsets, prepared)]


def load_preparer(path) -> tuple[ImagePreparer | None, str]:
    """The checkpoint's image preparer (None: it takes no images) and what a request with images is told then."""
    from nanostream.errors import ModelLoadError

    try:
        return ImagePreparer.from_pretrained(path), NO_IMAGES
    except ModelLoadError as exc:
        return None, str(exc)
