"""Images in, text out (issue 58), the client's side: where images come from (``sources``, under a
``policy``), how chat messages carry them (``chat``), and the checkpoint's processor that turns each into
the engine's input and widens its placeholder in the prompt (``processor``).

    template_messages, sources = split_image_parts(messages)
    images = [preparer.prepare(image) for image in load_images(sources, policy)]
    prompt_ids = preparer.expand_placeholders(tokenizer.apply_chat_template(template_messages, ...), images)
"""

from nanostream.multimodal.chat import split_image_parts
from nanostream.multimodal.policy import ImageError, ImagePolicy, check_count
from nanostream.multimodal.processor import ImagePreparer, PreparedImage
from nanostream.multimodal.sources import ImageSource, load_image, load_images

__all__ = [
    "ImageError",
    "ImagePolicy",
    "ImagePreparer",
    "ImageSource",
    "PreparedImage",
    "check_count",
    "load_image",
    "load_images",
    "split_image_parts",
]
