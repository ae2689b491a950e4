"""Image classification data: the ``data=images_generated``, ``images_random`` and
``images_folder`` options, in parts.

- ``generated``: textured images rendered from a seed (the quick start), or written as PNG folders;
- ``transforms``: the GPipe paper's transforms (random-resized crop, flip, cutout; resize + crop);
- ``files``: reading image files (any kind as RGB, an unreadable one named) and checking the image
  root, its class folders and the class count;
- ``hf``: images through Hugging Face ``datasets`` (tables or folders) and its progress bars;
- ``folders``: train and val data sets from an ImageNet-style root (torchvision or ``hf``);
- ``loaders``: loader workers, the resumable batch sampler and per-image augmentation seeds;
- ``bundle``: the three options' builders, each returning a DataBundle for the runner.

Import from the modules; this package stays empty so a run loads only what it needs.
"""
