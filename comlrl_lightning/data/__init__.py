from comlrl_lightning.data.preferences import PreferenceDataModule
from comlrl_lightning.data.tasks import EpochSampler, TaskDataModule, load_items

__all__ = ["EpochSampler", "PreferenceDataModule", "TaskDataModule", "load_items"]
