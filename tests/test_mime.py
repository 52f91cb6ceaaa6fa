"""MIME classification (pure logic): one answer for "is this text?" and "is this an image?".

The security property: only an explicit list of types is text; anything else (webp, pdf, video,
unknown types) is binary and so budgeted as binary by every caller."""

from __future__ import annotations

import pytest

from sandkernel.mime import API_IMAGE_MIME_TYPES, IMAGE_MIME_TYPES, is_api_image, is_binary, is_image, is_text


@pytest.mark.parametrize(
    "mime",
    [
        "text/plain",
        "text/html",
        "text/markdown",
        "text/latex",
        "Text/Plain; charset=utf-8",
        "application/json",
        "application/javascript",
        "application/vnd.jupyter.widget-view+json",
        "application/vnd.plotly.v1+json",
        "application/xml",
        "application/atom+xml",
    ],
)
def test_text_like_types(mime: str) -> None:
    assert is_text(mime) and not is_binary(mime)


@pytest.mark.parametrize(
    "mime",
    [
        "image/png",
        "image/webp",
        "image/svg+xml",
        "application/pdf",
        "application/octet-stream",
        "application/x-made-up",
        "video/mp4",
        "audio/wav",
        "model/gltf+json",  # +json outside application/ is not trusted as text
        "textual/plain",
        "",
        "nonsense",
    ],
)
def test_everything_else_is_binary(mime: str) -> None:
    assert not is_text(mime) and is_binary(mime)


def test_image_lists() -> None:
    assert set(API_IMAGE_MIME_TYPES) == {"image/png", "image/jpeg", "image/gif", "image/webp"}
    assert set(API_IMAGE_MIME_TYPES) < set(IMAGE_MIME_TYPES) and "image/svg+xml" in IMAGE_MIME_TYPES
    assert is_image("IMAGE/WEBP") and is_image("image/svg+xml") and not is_image("application/pdf")
    assert is_api_image("image/webp") and not is_api_image("image/svg+xml")
