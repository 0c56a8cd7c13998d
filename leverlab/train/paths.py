"""Where training state (work dir, gitignored) and the committed outputs (models/) live."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from leverlab.train.model_configs import DRAFT_NAME, TARGET_NAME

REPO_ROOT = Path(__file__).resolve().parents[2]
MODELS_DIR = REPO_ROOT / "models"


@dataclass(frozen=True)
class Paths:
    work: Path
    models: Path = MODELS_DIR

    @property
    def tokenizer(self) -> Path:
        return self.work / "tokenizer"

    @property
    def data(self) -> Path:
        return self.work / "data"

    @property
    def target_run(self) -> Path:
        return self.work / "target"

    @property
    def draft_run(self) -> Path:
        return self.work / "draft"

    @property
    def target_out(self) -> Path:
        return self.models / TARGET_NAME

    @property
    def draft_out(self) -> Path:
        return self.models / DRAFT_NAME

    @property
    def workload(self) -> Path:
        return self.models / "workload.json"
