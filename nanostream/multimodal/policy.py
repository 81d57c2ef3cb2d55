"""What a server lets a request's images be: ``ImagePolicy``, and ``ImageError``, the refusal of one.

    ImagePolicy()                                         a server's defaults: no URL fetched, no file read
    ImagePolicy(allowed_domains=frozenset({"example.com"}), allowed_local_path="/srv/media")
    ImagePolicy.trusted()                                 LLM / AsyncClient: local files anywhere

The server's options name the fields: ``--allowed-media-domains``, ``--allowed-local-media-path``.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, replace
from typing import Any

from nanostream.errors import InvalidRequestError

MiB = 1 << 20


class ImageError(InvalidRequestError):
    """An image the request cannot use: not allowed, too large, or not readable as an image.
    The message names the image (counted from 1) and says what to change."""


@dataclass(frozen=True)
class ImagePolicy:
    """What a request's images may be and where they may come from. The defaults are a server's:
    no URL fetched and no local file read until allowed; ``trusted()`` is for in-process users."""

    max_images: int = 16
    """Images in one request (``check_count``)."""
    max_image_pixels: int = 40_000_000
    """Width x height of one image, checked on its header before it is decoded."""
    max_image_bytes: int = 20 * MiB
    """Encoded size of one image: bytes given, read from a file or downloaded."""
    allowed_domains: frozenset[str] = frozenset()
    """Hosts http(s) images may come from, each with its subdomains (``--allowed-media-domains``)."""
    allowed_local_path: str | None = None
    """The directory local files (paths and ``file://`` URLs) may be read from, links and ``..`` resolved
    (``--allowed-local-media-path``); None reads none."""
    fetch_timeout: float = 10.0
    """Seconds to wait on an http(s) server (to connect, and for each read)."""

    def __post_init__(self) -> None:
        for name in ("max_images", "max_image_pixels", "max_image_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ImagePolicy.{name} must be a positive int, not {value!r}")
        if not (isinstance(self.fetch_timeout, (int, float)) and self.fetch_timeout > 0):
            raise ValueError(
                f"ImagePolicy.fetch_timeout must be a positive number of seconds, not {self.fetch_timeout!r}"
            )
        if isinstance(self.allowed_domains, str):
            raise TypeError(
                f"ImagePolicy.allowed_domains is a set of host names, not one string: {{{self.allowed_domains!r}}}"
            )
        # normalised once here (lower case, no trailing dot), so every lookup compares like with like
        object.__setattr__(self, "allowed_domains", frozenset(_domain(d) for d in self.allowed_domains))
        if self.allowed_local_path is not None:
            root = os.path.realpath(self.allowed_local_path)
            if not os.path.isdir(root):
                raise ValueError(f"--allowed-local-media-path {self.allowed_local_path!r} is not a directory")
            object.__setattr__(self, "allowed_local_path", root)

    @classmethod
    def trusted(cls, **overrides: Any) -> ImagePolicy:
        """The policy of an in-process user (``LLM``, ``AsyncClient``): local files anywhere; URLs still
        only from ``allowed_domains``; the size limits as a server's. ``ImagePolicy.trusted(max_images=64)``."""
        return replace(cls(allowed_local_path=os.path.abspath(os.sep)), **overrides)

    def allows_host(self, host: str) -> bool:
        """Whether ``host`` is an allowed domain or a subdomain of one (an IP address must match exactly)."""
        host = host.lower().rstrip(".")
        if host in self.allowed_domains:
            return True
        return not _is_ip(host) and any(host.endswith("." + d) for d in self.allowed_domains if not _is_ip(d))


def check_count(n: int, policy: ImagePolicy) -> None:
    """Refuse a request of ``n`` images when that is over ``policy.max_images``; call it before loading any."""
    if n > policy.max_images:
        raise ImageError(f"the request holds {n} images, over the server's limit of {policy.max_images}; send fewer")


def check_bytes(size: int, policy: ImagePolicy, what: str) -> None:
    """Refuse ``size`` encoded bytes of image ``what`` when over ``policy.max_image_bytes``."""
    if size > policy.max_image_bytes:
        raise ImageError(
            f"{what} is {_bytes(size)} or more encoded, over the server's limit of "
            f"{_bytes(policy.max_image_bytes)}; send a smaller or more compressed image"
        )


def _bytes(n: int) -> str:
    return f"{n / MiB:.3g} MiB" if n >= MiB else f"{n} bytes"


def _domain(name: str) -> str:
    domain = str(name).strip().lower().rstrip(".")
    if _is_ip(domain.strip("[]")):
        return domain.strip("[]")
    if not domain or any(c in domain for c in "/:*@ "):
        raise ValueError(
            f"--allowed-media-domains takes host names such as 'example.com' (its subdomains count too), not {name!r}"
        )
    return domain


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
