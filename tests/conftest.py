"""Shared test settings: small thread pools so the suite behaves on a 2-core machine."""

import os

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HYDRA_FULL_ERROR", "0")
