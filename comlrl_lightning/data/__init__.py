from comlrl_lightning.data.tasks import EpochSampler, TaskDataModule, load_items

__all__ = ["EpochSampler", "TaskDataModule", "load_items"]
