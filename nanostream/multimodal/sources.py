"""Where a request's images come from, and what a server lets them come from.

``load_image(source, policy)`` turns one image source into an upright RGB ``PIL.Image.Image``; an
``ImagePolicy`` (policy.py) says which sources are allowed and how large an image may be. Every refusal is an
``ImageError`` (an ``InvalidRequestError``, so a ``ValueError``) whose message says what to change::

    policy = ImagePolicy(allowed_domains=frozenset({"example.com"}))      # a server's
    image = load_image("https://cdn.example.com/cat.png", policy)           # subdomains count
    image = load_image(Path("cat.png"), ImagePolicy.trusted())             # LLM / AsyncClient

A source is a PIL image; encoded bytes (bytes, bytearray, memoryview); a ``data:image/...;base64,`` URL;
an ``http(s)://`` URL whose host is in ``allowed_domains``; or a ``file://`` URL or path under
``allowed_local_path``. Images are counted from 1 in messages ("image 2 is ...").

Decoding follows transformers' ``load_image``: the EXIF orientation is applied, then the image becomes RGB.
Beyond it: a transparent image is laid over white (transformers drops alpha, which turns transparent pixels
into whatever colour they hold, often black); 16-bit grey is scaled to 8 bits (Pillow's own conversion
clips it, turning most of the picture white); an animation gives its first frame.

Decompression bombs: ``Image.open`` reads the header only, so the size is checked before a pixel is
decoded. Pillow's process-wide ``Image.MAX_IMAGE_PIXELS`` is left as it is: its check still runs at open
(a warning above it, ``DecompressionBombError`` above twice it, refused here as too large), so a policy
cannot raise the limit past Pillow's.
"""

from __future__ import annotations

import base64
import binascii
import http.client
import io
import os
import re
import struct
import urllib.error
import urllib.request
from urllib.parse import urlsplit

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from nanostream.multimodal.policy import ImageError, ImagePolicy, check_bytes, check_count

ImageSource = Image.Image | bytes | bytearray | memoryview | str | os.PathLike

# The formats decoded. Left out on purpose: EPS (Pillow runs Ghostscript on it) and the long tail of rare
# formats whose decoders see little use; a format this Pillow lacks (AVIF before Pillow 11.3) is skipped.
FORMATS = ("PNG", "JPEG", "MPO", "WEBP", "GIF", "BMP", "TIFF", "AVIF")
# What Pillow's decoders raise on bad data besides its own errors.
_DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, struct.error, IndexError, TypeError, ZeroDivisionError)
_DATA_URL = re.compile(r"data:(?P<mime>[^;,]*)(?P<params>(?:;[^;,]*)*),(?P<payload>.*)", re.DOTALL)
_SIXTEEN_BIT = ("I", "I;16", "I;16L", "I;16B", "I;16N")


def load_images(sources: list[ImageSource], policy: ImagePolicy) -> list[Image.Image]:
    """Every image of one request, in order, after ``check_count``: ``load_image`` on each."""
    check_count(len(sources), policy)
    return [load_image(source, policy, index=i) for i, source in enumerate(sources)]


def load_image(source: ImageSource, policy: ImagePolicy, *, index: int | None = None) -> Image.Image:
    """One image source (see the module docstring) as an upright RGB image; ``index`` (from 0) names it
    in error messages as "image {index + 1}"."""
    what = "the image" if index is None else f"image {index + 1}"
    if isinstance(source, Image.Image):
        _check_pixels(source.size, policy, what)
        return _to_rgb(source, what)
    if isinstance(source, (bytes, bytearray, memoryview)):
        return _decode(bytes(source), policy, what)
    if isinstance(source, os.PathLike):
        return _decode(_read_file(os.fspath(source), policy, what), policy, what)
    if not isinstance(source, str):
        raise ImageError(
            f"{what} is a {type(source).__name__}; send a URL (http(s), data: or file:), a path, bytes or a PIL image"
        )
    scheme = source.split(":", 1)[0].lower() if re.match(r"[A-Za-z][A-Za-z0-9+.-]+:", source) else ""
    if scheme == "data":
        return _decode(_data_url(source, policy, what), policy, what)
    if scheme in ("http", "https"):
        return _decode(_fetch(source, policy, what), policy, what)
    if scheme == "file":
        parts = urlsplit(source)
        if parts.netloc not in ("", "localhost"):
            raise ImageError(f"{what}: a file:// URL names a file of this machine (file:///path), not {parts.netloc!r}")
        return _decode(_read_file(urllib.request.url2pathname(parts.path), policy, what), policy, what)
    if scheme:
        raise ImageError(f"{what}: {scheme}: URLs are not read; send an http(s):// or data:image/...;base64, URL")
    return _decode(_read_file(source, policy, what), policy, what)


def _decode(data: bytes, policy: ImagePolicy, what: str) -> Image.Image:
    if not data:
        raise ImageError(f"{what} is empty (0 bytes); send the image's bytes")
    check_bytes(len(data), policy, what)
    try:
        image = Image.open(io.BytesIO(data), formats=[f for f in FORMATS if _has_format(f)])
    except Image.DecompressionBombError as exc:
        raise ImageError(f"{what} is too large to decode ({exc}); send a smaller image") from exc
    except UnidentifiedImageError as exc:
        raise ImageError(
            f"{what} is in no image format this server reads; send a PNG, JPEG, WebP, GIF, BMP or TIFF"
        ) from exc
    except _DECODE_ERRORS as exc:
        raise ImageError(f"{what} could not be read as an image ({exc}); send an intact image file") from exc
    _check_pixels(image.size, policy, what)  # the header's size: nothing is decoded before this
    return _to_rgb(image, what)


def _to_rgb(image: Image.Image, what: str) -> Image.Image:
    try:
        image.load()  # the first frame only, of an animation
        image = ImageOps.exif_transpose(image)  # the upright picture, as transformers' load_image gives
    except _DECODE_ERRORS as exc:
        raise ImageError(f"{what} is corrupt or truncated ({exc}); send an intact image file") from exc
    if image.mode in _SIXTEEN_BIT:  # 0..65535 grey: the high byte, where Pillow's convert() would clip
        image = Image.fromarray((np.clip(np.asarray(image, dtype=np.int64), 0, 65535) >> 8).astype(np.uint8))
    if image.mode == "P" or "transparency" in image.info:
        image = image.convert("RGBA")
    if image.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        image = Image.alpha_composite(Image.new("RGBA", image.size, "white"), image.convert("RGBA"))
    return image.convert("RGB")


def _check_pixels(size: tuple[int, int], policy: ImagePolicy, what: str) -> None:
    width, height = size
    if width * height > policy.max_image_pixels:
        raise ImageError(
            f"{what} is {width}x{height} = {_mega(width * height)} megapixels, over the server's limit of "
            f"{_mega(policy.max_image_pixels)}; send a smaller image"
        )
    if width < 1 or height < 1:
        raise ImageError(f"{what} is {width}x{height}, with no pixels; send a picture")


def _data_url(url: str, policy: ImagePolicy, what: str) -> bytes:
    match = _DATA_URL.fullmatch(url)
    if match is None or not match["mime"].lower().startswith("image/"):
        raise ImageError(f"{what}: a data URL must read data:image/<type>;base64,<data>; this one starts {url[:40]!r}")
    if "base64" not in (p.strip().lower() for p in match["params"].split(";")):
        raise ImageError(f"{what}: the data URL is not base64 (data:image/<type>;base64,<data>); encode the image so")
    payload = match["payload"]
    check_bytes(len(payload) * 3 // 4, policy, what)  # the decoded size, before decoding it
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageError(f"{what}: the data URL's base64 is malformed ({exc}); send standard base64") from exc


def _read_file(path: str, policy: ImagePolicy, what: str) -> bytes:
    if policy.allowed_local_path is None:
        raise ImageError(
            f"{what} is a local file, which this server does not read; send its bytes in a data: URL, or start the "
            "server with --allowed-local-media-path DIR to read files under DIR"
        )
    root, resolved = policy.allowed_local_path, os.path.realpath(path)  # links and '..' resolved
    if os.path.commonpath([root, resolved]) != root:
        raise ImageError(f"{what}: {path!r} is outside --allowed-local-media-path {root!r}; send a file inside it")
    if not os.path.isfile(resolved):
        raise ImageError(f"{what}: {path!r} is not a file; send an image file's path")
    try:
        with open(resolved, "rb") as file:
            data = file.read(policy.max_image_bytes + 1)
    except OSError as exc:
        raise ImageError(f"{what}: {path!r} could not be read ({exc.strerror})") from exc
    check_bytes(len(data), policy, what)
    return data


class _AllowedRedirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to an allowed host: an allowed server cannot point the fetch anywhere else."""

    def __init__(self, policy: ImagePolicy, what: str) -> None:
        self.policy, self.what = policy, what

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
        _check_url(newurl, self.policy, self.what)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _check_url(url: str, policy: ImagePolicy, what: str) -> None:
    parts = urlsplit(url)
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise ImageError(f"{what}: {url[:100]!r} is not an http(s) URL with a host; send one that is")
    if not policy.allows_host(parts.hostname):
        allowed = ", ".join(sorted(policy.allowed_domains)) or "none"
        raise ImageError(
            f"{what}: images from {parts.hostname!r} are not fetched (--allowed-media-domains: {allowed}); "
            "send the image's bytes in a data: URL, or start the server with that domain allowed"
        )


def _fetch(url: str, policy: ImagePolicy, what: str) -> bytes:
    _check_url(url, policy, what)
    opener = urllib.request.build_opener(_AllowedRedirects(policy, what))
    request = urllib.request.Request(url, headers={"Accept": "image/*", "User-Agent": "nanostream"})
    try:
        with opener.open(request, timeout=policy.fetch_timeout) as response:
            length = response.headers.get("Content-Length", "")
            if length.isdigit():
                check_bytes(int(length), policy, what)
            data = response.read(policy.max_image_bytes + 1)  # never more than one byte over the limit
    except urllib.error.HTTPError as exc:
        raise ImageError(
            f"{what}: {url[:100]} answered {exc.code} {exc.reason}; send a URL that serves the image"
        ) from exc
    except urllib.error.URLError as exc:
        raise ImageError(f"{what}: {url[:100]} could not be fetched ({exc.reason})") from exc
    except (OSError, http.client.HTTPException) as exc:  # a timeout is an OSError too
        raise ImageError(f"{what}: fetching {url[:100]} failed ({exc or type(exc).__name__})") from exc
    check_bytes(len(data), policy, what)
    return data


def _has_format(name: str) -> bool:
    Image.init()  # registers Pillow's plugins once (what Image.open itself does)
    return name in Image.OPEN


def _mega(n: float) -> str:
    return f"{n / 1e6:.3g}"
