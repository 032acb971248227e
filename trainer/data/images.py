"""Image classification data: a class-per-folder image tree, and synthetic images.

Both are indexable like the token windows (`num_windows`, `dataset[k]`), so the step-indexed
sampler in trainer/data/tokens.py serves them unchanged: which images a rank reads at a step is a pure
function of (step, batch shape, rank, seed), and a resumed run reads exactly what it would have.
An item is (image [channels, size, size] float32, label).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import numpy as np

log = logging.getLogger("trainer")

if TYPE_CHECKING:  # torch is imported where images are made: the config checks use this module
    import torch

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp")
# ImageNet channel statistics: what pretrained vision models expect their inputs scaled by.
MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)
SYNTHETIC_TRAIN_IMAGES = 1 << 20
SYNTHETIC_VAL_IMAGES = 256
_TEMPLATE_SIZE = 8  # synthetic classes differ in a coarse 8x8 pattern under the noise


def class_folders(root: str) -> list[str]:
    """Sorted names of the class folders under root (each holding that class's images)."""
    return sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))


def has_image(folder: str) -> bool:
    """Whether folder holds at least one image file (stops at the first)."""
    return any(e.is_file() and e.name.lower().endswith(IMAGE_EXTENSIONS)
               for e in os.scandir(folder))


class ImageFolder:
    """root/<class>/<image>, labels numbered by sorted class name (as torchvision does).

    Images are decoded with Pillow, converted to RGB (or L for one channel), resized so the
    shorter side is `image_size`, centre-cropped to a square and scaled by the ImageNet
    statistics, or by the model's own (`preprocess`: image_mean, image_std and a Pillow
    `resample` code, from a pretrained folder's preprocessor_config.json). `classes` fixes the
    label numbering (the validation folder uses the training folder's).

    With `augment`, training samples (`sample(index, draw)`) are instead a random crop of 8% to
    100% of the image's area at an aspect ratio from 3/4 to 4/3, resized to the square, and
    mirrored half of the time: the usual fine-tuning augmentation. Its randomness comes from
    (seed, draw), the sample's global position in the run, so it differs between epochs and is
    the same after a resume.
    """

    def __init__(self, root: str, image_size: int, channels: int, key: str,
                 classes: list[str] | None = None, augment: bool = False, seed: int = 0,
                 skip_bad: bool = False, preprocess: dict | None = None) -> None:
        preprocess = preprocess or {}
        self.mean = np.asarray(preprocess.get("image_mean", MEAN), dtype=np.float32)
        self.std = np.asarray(preprocess.get("image_std", STD), dtype=np.float32)
        self.resample = int(preprocess.get("resample", 3))  # 3: Pillow's bicubic
        if not os.path.isdir(root):
            raise ValueError(f"{key}: no such folder: {root}")
        found = class_folders(root)
        self.classes = classes if classes is not None else found
        unknown = sorted(set(found) - set(self.classes))
        if unknown:
            raise ValueError(f"{key}: class folders {unknown} are not among the training "
                             f"classes {self.classes}")
        self.files: list[tuple[str, int]] = []
        for label, name in enumerate(self.classes):
            folder = os.path.join(root, name)
            if not os.path.isdir(folder):
                continue
            for entry in sorted(os.scandir(folder), key=lambda e: e.name):
                if entry.is_file() and entry.name.lower().endswith(IMAGE_EXTENSIONS):
                    self.files.append((entry.path, label))
        if not self.files:
            raise ValueError(f"{key}: no images ({', '.join(IMAGE_EXTENSIONS)}) under {root}")
        self.image_size, self.channels = image_size, channels
        self.augment, self.seed = augment, seed
        self.key, self.skip_bad = key, skip_bad
        self.skipped: set[str] = set()  # unreadable files met so far (skip_bad)
        self.num_windows = len(self.files)

    def __len__(self) -> int:
        return self.num_windows

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        """Image `index`, centre-cropped (validation, and training without augment)."""
        return self._load(index, None)

    def sample(self, index: int, draw: int) -> tuple[torch.Tensor, int]:
        """Image `index` as the training sample at global position `draw`."""
        return self._load(index, np.random.default_rng([self.seed, draw]) if self.augment
                          else None)

    def _load(self, index: int, rng: np.random.Generator | None) -> tuple[torch.Tensor, int]:
        """The image at `index`; an unreadable one stops the run naming the file, or with
        skip_bad is replaced by the next readable image (the same on every rank and run)."""
        for offset in range(len(self.files)):
            path = self.files[(index + offset) % len(self.files)][0]
            if path in self.skipped:
                continue
            try:
                return self._decode((index + offset) % len(self.files), rng)
            except Exception as exc:  # Pillow raises many types for a bad file
                reason = f"{type(exc).__name__}: {exc}"
                if not self.skip_bad:
                    raise ValueError(f"{self.key}: {path} cannot be read as an image ({reason}); "
                                     "replace or remove it, or set data.skip_bad_images=true to "
                                     "skip such files") from None
                self.skipped.add(path)
                log.warning("data.skip_bad_images: skipping %s (%s); %d skipped so far", path,
                            reason, len(self.skipped))
        raise ValueError(f"{self.key}: no image under {self.files[0][0]}'s folder can be read")

    def _decode(self, index: int, rng: np.random.Generator | None) -> tuple[torch.Tensor, int]:
        from PIL import Image

        path, label = self.files[index]
        size = self.image_size
        with Image.open(path) as image:
            image = image.convert("RGB" if self.channels == 3 else "L")
            width, height = image.size
            if rng is None:
                scale = size / min(width, height)
                resized = (max(size, round(width * scale)), max(size, round(height * scale)))
                image = image.resize(resized, Image.Resampling(self.resample))
                left, top = (resized[0] - size) // 2, (resized[1] - size) // 2
                image = image.crop((left, top, left + size, top + size))
            else:
                image = image.resize((size, size), Image.Resampling(self.resample),
                                     box=_random_box(width, height, rng))
                if rng.random() < 0.5:
                    image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
            pixels = np.asarray(image, dtype=np.float32) / 255.0
        if pixels.ndim == 2:
            pixels = pixels[:, :, None]
        return _normalise(pixels.transpose(2, 0, 1), self.mean, self.std), label


def _random_box(width: int, height: int, rng: np.random.Generator) -> tuple[int, int, int, int]:
    """A crop of 8-100% of the area at aspect 3/4-4/3 (up to 10 tries; else the centre square)."""
    for _ in range(10):
        area = width * height * rng.uniform(0.08, 1.0)
        aspect = float(np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3))))
        w, h = round((area * aspect) ** 0.5), round((area / aspect) ** 0.5)
        if 0 < w <= width and 0 < h <= height:
            left, top = int(rng.integers(0, width - w + 1)), int(rng.integers(0, height - h + 1))
            return left, top, left + w, top + h
    side = min(width, height)
    left, top = (width - side) // 2, (height - side) // 2
    return left, top, left + side, top + side


def _normalise(pixels: np.ndarray, mean: np.ndarray = MEAN, std: np.ndarray = STD
               ) -> torch.Tensor:
    import torch

    channels = pixels.shape[0]
    mean = mean[:channels] if len(mean) == channels else mean.mean(keepdims=True)
    std = std[:channels] if len(std) == channels else std.mean(keepdims=True)
    return torch.from_numpy(np.ascontiguousarray((pixels - mean[:, None, None]) /
                                                 std[:, None, None]))


class SyntheticImages:
    """Random images with learnable labels, for benchmarks and tests at any resolution.

    Image k depends only on (seed, stream, k): its label is drawn, and the image is that class's
    coarse random pattern (fixed by the seed) plus unit Gaussian noise. So accuracy above chance
    shows the model learns, and any image is made in O(1) with no state.
    """

    def __init__(self, num_classes: int, image_size: int, channels: int, num_images: int,
                 seed: int, stream: int = 0) -> None:
        self.num_classes, self.image_size, self.channels = num_classes, image_size, channels
        self.num_windows, self.seed, self.stream = num_images, seed, stream
        rng = np.random.default_rng([seed, 1 << 30])  # the same classes for both streams
        self.templates = rng.standard_normal(
            (num_classes, channels, _TEMPLATE_SIZE, _TEMPLATE_SIZE)).astype(np.float32)

    def __len__(self) -> int:
        return self.num_windows

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not 0 <= index < self.num_windows:
            raise IndexError(f"image {index} out of range [0, {self.num_windows})")
        rng = np.random.default_rng([self.seed, self.stream, index])
        label = int(rng.integers(self.num_classes))
        size = self.image_size
        repeat = -(-size // _TEMPLATE_SIZE)  # ceil: any size, cropped back below
        pattern = self.templates[label].repeat(repeat, axis=1).repeat(repeat, axis=2)
        noise = rng.standard_normal((self.channels, size, size), dtype=np.float32)
        import torch

        return torch.from_numpy(pattern[:, :size, :size] + noise), label


def image_datasets(source: str, image_size: int, channels: int, num_classes: int, seed: int,
                   train_path: str | None, val_path: str | None, augment: bool,
                   skip_bad: bool = False, preprocess: dict | None = None
                   ) -> tuple[ImageFolder | SyntheticImages, ...]:
    """(train, val) for data.source in {'images', 'synthetic_images'}."""
    if source == "synthetic_images":
        return (SyntheticImages(num_classes, image_size, channels, SYNTHETIC_TRAIN_IMAGES, seed, 0),
                SyntheticImages(num_classes, image_size, channels, SYNTHETIC_VAL_IMAGES, seed, 1))
    if source != "images":
        raise ValueError(f"data.source={source} is not an image source")
    train = ImageFolder(train_path, image_size, channels, "data.train_path", augment=augment,
                        seed=seed, skip_bad=skip_bad, preprocess=preprocess)
    if len(train.classes) != num_classes:
        raise ValueError(f"model.num_classes={num_classes} but {train_path} has "
                         f"{len(train.classes)} class folders; set model.num_classes="
                         f"{len(train.classes)}")
    val = ImageFolder(val_path, image_size, channels, "data.val_path", classes=train.classes,
                      skip_bad=skip_bad, preprocess=preprocess)
    return train, val
