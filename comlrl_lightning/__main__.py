from comlrl_lightning.cli import command

command()
