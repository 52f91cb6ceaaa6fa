"""MIME classification, in one place: which output types are text and which are images.

Every layer asks the same two questions of a MIME bundle: is this value text a person (or a model)
reads, and is it an image we render? Four copies of the answer drifted apart (``image/webp`` was an
image to the agent but neither text nor image to the reply budget, so it escaped the budget), so the
answer lives here, in the common base: this module imports nothing from sandkernel's subpackages.

The rule that matters for security is :func:`is_text`'s: a type is text only if it is on a short,
explicit list (``text/*``, JSON and ``+json``, JavaScript, XML outside ``image/``). Everything else
(``image/webp``, ``application/pdf``, ``video/*``, a type nobody has heard of) is *not* text and
counts against the binary/image budget: an unknown type can never escape a budget by being unknown.

Types are compared without parameters and case-insensitively (``Text/Plain; charset=utf-8`` is
``text/plain``), as RFC 2045 says MIME types are.
"""

from __future__ import annotations

# Images sandkernel renders or compares as images (raster and vector). Order is preference order
# when one bundle carries several (as Jupyter front-ends choose).
IMAGE_MIME_TYPES: tuple[str, ...] = ("image/png", "image/jpeg", "image/gif", "image/webp", "image/svg+xml")

# Images the Anthropic Messages API accepts as image blocks (not SVG).
API_IMAGE_MIME_TYPES: tuple[str, ...] = ("image/png", "image/jpeg", "image/gif", "image/webp")

# Text-like types outside ``text/*`` and the ``+json`` / ``+xml`` suffixes: what Jupyter front-ends
# display as text or code (application/javascript is what IPython.display.Javascript emits).
TEXT_MIME_TYPES: frozenset[str] = frozenset(
    {
        "application/json",
        "application/javascript",
        "application/ecmascript",
        "application/x-javascript",
        "application/xml",
        "application/x-latex",
        "application/x-tex",
        "application/x-sh",
        "application/x-python",
        "application/sql",
        "application/yaml",
        "application/x-yaml",
        "application/toml",
    }
)


def essence(mime: str) -> str:
    """The type without parameters, lower case: ``"Text/HTML; charset=utf-8"`` → ``"text/html"``."""
    return mime.split(";", 1)[0].strip().lower()


def is_image(mime: str) -> bool:
    """True for the image types sandkernel renders (:data:`IMAGE_MIME_TYPES`)."""
    return essence(mime) in IMAGE_MIME_TYPES


def is_api_image(mime: str) -> bool:
    """True for the image types the Anthropic API accepts (:data:`API_IMAGE_MIME_TYPES`)."""
    return essence(mime) in API_IMAGE_MIME_TYPES


def is_text(mime: str) -> bool:
    """True for text-like types: ``text/*``, ``application/json`` and any ``+json``, JavaScript,
    XML and ``+xml`` (outside ``image/``: SVG is an image), and :data:`TEXT_MIME_TYPES`.

    Anything else is binary (or unknown) and must be budgeted as such: callers treat
    ``not is_text(mime)`` as "counts against the binary/image budget".
    """
    kind = essence(mime)
    if "/" not in kind:
        return False
    major, _, minor = kind.partition("/")
    if major == "text":
        return True
    if major != "application":
        return False
    return kind in TEXT_MIME_TYPES or minor.endswith("+json") or minor.endswith("+xml")


def is_base64(mime: str) -> bool:
    """True when nbformat stores a value of this type base64-encoded: binary types, except SVG
    (XML text, stored as it is, like every text-like type)."""
    return is_binary(mime) and essence(mime) != "image/svg+xml"


def is_binary(mime: str) -> bool:
    """Not text-like: counts against the binary/image budget (images, PDFs, video, unknown types)."""
    return not is_text(mime)
