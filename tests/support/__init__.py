"""What the tests share, none of it a test module (tests/unit/test_test_tools.py keeps it so).

ranks.py       the one rank launcher: gloo ranks on loopback, spawned or under torchrun
train.py       ``train.py`` (or another script) in a subprocess, and its output read
runs.py        small experiment configs and the checks the runner's tests share
nccl_rules.py  NCCL's ordering rules replayed on the CPU, and a fake network of ranks on threads
scripts.py     a recipe or benchmark script imported as a module
"""
