"""Images for the model: what the code displayed, as Messages API image blocks, downscaled.

Why downscale on the host: the API resizes anything over ~1.15 megapixels or 1568 px on the
long edge anyway, so sending more only costs tokens and latency. Images already within bounds
pass through byte for byte (never decoded); larger ones are decoded with Pillow under a pixel
ceiling (a decompression bomb from hostile code is refused, not expanded) and re-encoded as PNG.
"""

from __future__ import annotations

import base64
import io
from typing import Any

from PIL import Image as PILImage

from sandkernel.agent.execution import Image
from sandkernel.mime import is_api_image

MAX_EDGE = 1568
MAX_PIXELS = 1_150_000
MAX_BYTES = 3_750_000  # the API's per-image limit is 5 MB of base64
DECODE_CEILING = 50_000_000  # pixels; beyond this the image is refused unread


def image_block(image: Image) -> dict[str, Any] | str:
    """An image content block, or a sentence saying why the image cannot be shown."""
    if not is_api_image(image.mime_type):
        return f"[{image.mime_type} image not shown: the model accepts PNG, JPEG, GIF or WebP]"
    try:
        with PILImage.open(io.BytesIO(image.data)) as probe:  # reads the header only
            width, height = probe.size
            if width * height > DECODE_CEILING:
                return f"[{width}x{height} image not shown: too large to decode safely]"
            scale = min(1.0, MAX_EDGE / max(width, height), (MAX_PIXELS / (width * height)) ** 0.5)
            if scale == 1.0 and len(image.data) <= MAX_BYTES:
                data, mime = image.data, image.mime_type
            else:
                size = (max(1, int(width * scale)), max(1, int(height * scale)))
                resized = probe.convert("RGBA" if probe.mode in ("RGBA", "LA", "P") else "RGB").resize(
                    size, PILImage.Resampling.LANCZOS
                )
                buffer = io.BytesIO()
                resized.save(buffer, format="PNG", optimize=True)
                data, mime = buffer.getvalue(), "image/png"
    except PILImage.DecompressionBombError:
        return "[image not shown: too large to decode safely]"
    except (OSError, ValueError) as err:
        return f"[image not shown: it could not be read ({err})]"
    return {"type": "image", "source": {"type": "base64", "media_type": mime, "data": base64.b64encode(data).decode()}}
