"""Images as a model is shown them: downscaled on the host, under a decoding ceiling.

Why downscale on the host: models' APIs resize anything over ~1.15 megapixels or 1568 px on the
long edge anyway, so sending more only costs tokens and latency. Images already within bounds
pass through byte for byte (never decoded); larger ones are decoded with Pillow under a pixel
ceiling (a decompression bomb from hostile code is refused, not expanded) and re-encoded as PNG.
Every door that hands images to a model uses this (the agent loop's image blocks, the MCP
server's image content).
"""

from __future__ import annotations

import io

from sandkernel.mime import is_api_image

MAX_EDGE = 1568
MAX_PIXELS = 1_150_000
MAX_BYTES = 3_750_000  # the Messages API's per-image limit is 5 MB of base64
DECODE_CEILING = 50_000_000  # pixels; beyond this the image is refused unread


def fit_image(data: bytes, mime: str) -> tuple[bytes, str] | str:
    """``data`` as a model may be shown it (bytes and MIME type), downscaled when over the bounds,
    or a sentence saying why it cannot be shown."""
    if not is_api_image(mime):
        return f"[{mime} image not shown: the model accepts PNG, JPEG, GIF or WebP]"
    # Pillow is the agent's and the server's (extras), not the client's: imported when an image
    # is shown, so importing the agent loop (its help, its constants) needs no Pillow.
    from PIL import Image as PILImage

    try:
        with PILImage.open(io.BytesIO(data)) as probe:  # reads the header only
            width, height = probe.size
            if width * height > DECODE_CEILING:
                return f"[{width}x{height} image not shown: too large to decode safely]"
            scale = min(1.0, MAX_EDGE / max(width, height), (MAX_PIXELS / (width * height)) ** 0.5)
            if scale == 1.0 and len(data) <= MAX_BYTES:
                return data, mime
            size = (max(1, int(width * scale)), max(1, int(height * scale)))
            mode = "RGBA" if probe.mode in ("RGBA", "LA", "P") else "RGB"
            resized = probe.convert(mode).resize(size, PILImage.Resampling.LANCZOS)
            buffer = io.BytesIO()
            resized.save(buffer, format="PNG", optimize=True)
            return buffer.getvalue(), "image/png"
    except PILImage.DecompressionBombError:
        return "[image not shown: too large to decode safely]"
    except (OSError, ValueError) as err:
        return f"[image not shown: it could not be read ({err})]"
