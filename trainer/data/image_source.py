"""`data=images` (class-per-folder trees) and `data=synthetic_images`, read by image classifiers
(trainer/data/images.py) in the one seeded global order. How a pretrained model scales its
inputs (mean, std, resampling) is its family's to say: it comes in as `preprocess`."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Optional

from trainer.config import DataConfig, require
from trainer.data.base import ModelFacts, Source

if TYPE_CHECKING:
    from trainer.data.batches import Sampling


class ImageSource(Source):
    sample = "images"

    def check(self, d: DataConfig) -> None:
        require(not d.augment or self.name == "images", "data.augment",
                f"only applies to data=images (now data.source={self.name})")

    def check_reader(self, sample: str, arch: str) -> None:
        require(sample == self.sample, "data.source",
                f"{self.name} are images, which model.arch={arch} does not read; use "
                "model=vit or a text source (data=bytes, tokens or synthetic)")

    def check_files(self, d: DataConfig, model: ModelFacts) -> None:
        """data=images: two folders of the same class folders, each holding images, as many
        classes as the model has."""
        if self.name != "images":
            return
        paths = {"data.train_path": d.train_path, "data.val_path": d.val_path}
        for key, folder in paths.items():
            require(bool(folder) and os.path.isdir(folder), key,
                    f"data.source=images needs {key}=<folder of <class>/<image> folders>, got "
                    f"{folder}")
        from trainer.data.images import IMAGE_EXTENSIONS, class_folders, has_image

        classes = {}
        for key, root in paths.items():
            classes[key] = class_folders(root)
            require(bool(classes[key]), key,
                    f"{root} has no class folders ({root}/<class>/<image>)")
        found = len(classes["data.train_path"])
        require(found == model.num_classes, "model.num_classes",
                f"{model.num_classes}, but {d.train_path} has {found} class folders; set "
                f"model.num_classes={found}")
        extra = sorted(set(classes["data.val_path"]) - set(classes["data.train_path"]))
        require(not extra, "data.val_path", f"class folders {extra} are not in data.train_path")
        for key, root in paths.items():
            empty = [c for c in classes[key] if not has_image(os.path.join(root, c))]
            require(not empty, key, f"class folders {empty[:5]} under {root} hold no images "
                    f"({', '.join(IMAGE_EXTENSIONS)})")

    def datasets(self, d: DataConfig, model: ModelFacts, sampling: Sampling,
                 preprocess: Optional[dict] = None) -> tuple:
        from trainer.data.images import image_datasets

        return image_datasets(self.name, model.image_size, model.channels, model.num_classes,
                              sampling.seed, d.train_path, d.val_path, d.augment,
                              d.skip_bad_images, preprocess)
