"""What the tests share, none of it a test module (tests/unit/test_test_tools.py keeps it so).

forks.py       the fork server: ranks and ``train.py`` runs start from one interpreter's imports
ranks.py       the one rank launcher: ranks on loopback (gloo; NCCL on GPUs), spawned or torchrun
train.py       ``train.py`` (or another script) in a process of its own, and its output read
runs.py        small experiment configs and the checks the runner's tests share
nccl_rules.py  NCCL's ordering rules replayed on the CPU, and a fake network of ranks on threads
recording.py   every torch.distributed call a rank makes, recorded (to replay under NCCL's rule)
shards.py      every replica's share of a batch, and the plain model's step over them all
scripts.py     a recipe or benchmark script imported as a module
values.py      one check that values which crossed a transport arrived equal
"""
