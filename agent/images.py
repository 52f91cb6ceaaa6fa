"""Images for the model: what the code displayed, as Messages API image blocks, downscaled
(:func:`sandkernel.images.fit_image` says how and why)."""

from __future__ import annotations

import base64
from typing import Any

from sandkernel.agent.execution import Image
from sandkernel.images import fit_image


def image_block(image: Image) -> dict[str, Any] | str:
    """An image content block, or a sentence saying why the image cannot be shown."""
    fitted = fit_image(image.data, image.mime_type)
    if isinstance(fitted, str):
        return fitted
    data, mime = fitted
    return {"type": "image", "source": {"type": "base64", "media_type": mime, "data": base64.b64encode(data).decode()}}
