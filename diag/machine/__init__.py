"""What the machine is: the accelerator and its dense peak (device.py, from the table in gpus.py),
GPU utilisation sampled during timed runs (gpu_util.py), the kind of every disk (disks.py)."""
