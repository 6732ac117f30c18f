"""Data for ddddocr's two models: text captchas for its recognizer, click captchas for its
detector.

ddddocr 1.6.1 ships both in its wheel (MIT licence), exported from PyTorch 1.9 by the
TorchScript exporter:

- ``common.onnx``: a CNN (SiLU written as Sigmoid and Mul), a bidirectional LSTM and a linear
  layer over 8210 characters, read by greedy CTC (blank 0). It takes a grey image 64 pixels
  high scaled to [0, 1] (ddddocr's own preprocessing); its output is the logits
  ``[T, N, 8210]``. The captchas here are 160 pixels wide: 4 or 5 characters of Pillow's own
  font, each its own size, height and colour, on a light background crossed by lines, blurred
  in half of them.
- ``common_det.onnx``: a YOLOX detector of the characters of a click captcha (416x416, BGR,
  0-255, letterboxed on grey 114 as ddddocr does). The captchas here are crops of the
  photographs scikit-image 0.26.0 ships in its wheel (an astronaut, a cat, coffee, a rocket,
  a motorcycle, ...), letterboxed, with 3 to 5 outlined characters drawn on them.
"""

from __future__ import annotations

import io
from collections.abc import Callable

import numpy as np

OCR = ("ddddocr", "1.6.1", "ddddocr/common.onnx")
DETECTOR = ("ddddocr", "1.6.1", "ddddocr/common_det.onnx")
SKIMAGE = ("scikit-image", "0.26.0")
PHOTOS = ("astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg", "motorcycle_left.png",
          "hubble_deep_field.jpg", "retina.jpg", "ihc.png", "camera.png", "brick.png",
          "grass.png", "gravel.png")
OCR_HEIGHT, OCR_WIDTH, DETECTOR_SIDE = 64, 160, 416
CHARACTERS = "ABCDEFGHJKLMNPQRSTUVWXYZabcdefghjkmnpqrstuvwxyz23456789"


def _colour(rng: np.random.Generator, low: int, high: int) -> tuple[int, int, int]:
    r, g, b = (int(v) for v in rng.integers(low, high, 3))
    return r, g, b


def text_captchas(rng: np.random.Generator, n: int) -> np.ndarray:
    """[n, 1, 64, 160] grey captchas in [0, 1], as ddddocr feeds its recognizer."""
    from PIL import Image, ImageDraw, ImageFilter, ImageFont

    images = []
    for _ in range(n):
        image = Image.new("RGB", (OCR_WIDTH, OCR_HEIGHT), _colour(rng, 180, 256))
        draw = ImageDraw.Draw(image)
        for _ in range(4):
            ends = [(int(rng.integers(0, OCR_WIDTH)), int(rng.integers(0, OCR_HEIGHT)))
                    for _ in range(2)]
            draw.line(ends, fill=_colour(rng, 0, 200), width=int(rng.integers(1, 3)))
        x = 8
        for character in rng.choice(list(CHARACTERS), int(rng.integers(4, 6))):
            font = ImageFont.load_default(size=int(rng.integers(34, 46)))
            draw.text((x, int(rng.integers(0, 14))), str(character), font=font,
                      fill=_colour(rng, 0, 120))
            x += int(rng.integers(22, 30))
        if rng.random() < 0.5:
            image = image.filter(ImageFilter.GaussianBlur(0.8))
        images.append(np.asarray(image.convert("L"), np.float32)[None] / 255.0)
    return np.stack(images)


def photographs(read: Callable[[str], bytes]) -> list:
    """The PHOTOS as RGB Pillow images; `read` gives a member of scikit-image's wheel."""
    from PIL import Image

    return [Image.open(io.BytesIO(read(f"skimage/data/{name}"))).convert("RGB")
            for name in PHOTOS]


def click_captchas(rng: np.random.Generator, n: int, photos: list) -> np.ndarray:
    """[n, 3, 416, 416] click captchas, BGR 0-255 letterboxed on 114, as ddddocr feeds its
    detector."""
    from PIL import Image, ImageDraw, ImageFont

    images = []
    for _ in range(n):
        photo = photos[int(rng.integers(len(photos)))]
        width, height = photo.size
        share = rng.uniform(0.4, 1.0)
        crop_w, crop_h = int(width * share), int(height * share)
        x0, y0 = int(rng.integers(0, width - crop_w + 1)), int(rng.integers(0, height - crop_h + 1))
        crop = photo.crop((x0, y0, x0 + crop_w, y0 + crop_h))
        if rng.random() < 0.5:
            crop = crop.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        ratio = min(DETECTOR_SIDE / crop_w, DETECTOR_SIDE / crop_h)
        crop = crop.resize((max(1, int(crop_w * ratio)), max(1, int(crop_h * ratio))),
                           Image.Resampling.BILINEAR)
        canvas = Image.new("RGB", (DETECTOR_SIDE, DETECTOR_SIDE), (114, 114, 114))
        canvas.paste(crop, (0, 0))
        draw = ImageDraw.Draw(canvas)
        for _ in range(int(rng.integers(3, 6))):
            font = ImageFont.load_default(size=int(rng.integers(30, 60)))
            at = (int(rng.integers(0, DETECTOR_SIDE - 60)), int(rng.integers(0, DETECTOR_SIDE - 60)))
            draw.text(at, str(rng.choice(list(CHARACTERS))), font=font, fill=_colour(rng, 0, 256),
                      stroke_width=2, stroke_fill=(0, 0, 0))
        rgb = np.asarray(canvas, np.float32)
        images.append(rgb[:, :, ::-1].transpose(2, 0, 1))
    return np.ascontiguousarray(np.stack(images))

